"""The server's one error shape: OpenAI's ``{"error": {message, type, param, code}}`` with its HTTP status."""

SHUTTING_DOWN = "the server is shutting down"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}

    def renamed(self, names: dict[str, str]) -> "APIError":
        """This error naming its field as a body does, given ``names`` (a field or a dotted path's start -> the
        body's name for it; the longest start that has a name wins)."""
        path = (self.param or "").split(".")
        old = next((".".join(path[:n]) for n in range(len(path), 0, -1) if ".".join(path[:n]) in names), None)
        if old is None:
            return self
        new = names[old] + self.param[len(old):]
        message = self.message.removeprefix(f"{self.param}: ")
        return APIError(self.status, f"{new}: {message}", new, self.kind, self.headers)


def engine_gone(why: str) -> APIError:
    return APIError(503, why, kind="service_unavailable")


def overloaded(why: str, retry_after: int) -> APIError:
    return APIError(429, f"the server is overloaded: {why}; retry later", kind="rate_limit_exceeded",
                    headers={"retry-after": str(retry_after)})
