"""Tool calling on /v1/chat/completions, as vLLM does it (docs/api.md has each tool_choice's rules).

A named ``tool_choice`` or ``"required"`` forces the output through structured outputs (the call's schema);
``"auto"`` parses ``<tool_call>{...}</tool_call>`` out of the text (``--tool-call-parser hermes``). Each
way has an extractor whose ``feed(text, final)`` returns the content to show and the tool-call deltas in
OpenAI's streamed shape; a whole reply is the same deltas merged, so streamed and whole replies agree.
"""

import json
import uuid
from dataclasses import dataclass

from nanoengine.sampling_params import StructuredOutputsParams, field_error
from nanoengine.serve.protocol import ChatCompletionRequest, NamedToolChoice, Tool

TOOL_CALL_PARSERS = ("hermes",)
NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass
class ToolUse:
    tools: list[Tool]
    choice: str  # "auto", "required" or "named"
    name: str | None  # the named function
    parallel: bool  # more than one call allowed
    parser: str | None  # for "auto"

    @classmethod
    def of(cls, body: ChatCompletionRequest, parser: str | None) -> "ToolUse | None":
        """The request's tool use, checked; None when no call is to be made or parsed (no tools, or "none")."""
        choice = "auto" if body.tool_choice is None and body.tools else body.tool_choice or "none"
        if not body.tools:
            if choice != "none":
                raise field_error("tool_choice", f"tool_choice {described(choice)} needs tools")
            return None
        names = [tool.function.name for tool in body.tools]
        if len(set(names)) < len(names):
            twice = sorted(name for name in set(names) if names.count(name) > 1)
            raise field_error("tools", f"tools name a function twice: {twice}")
        if choice == "none":
            return None
        name = None
        if isinstance(choice, NamedToolChoice):
            name, choice = choice.function.name, "named"
            if name not in names:
                raise field_error("tool_choice", f"tool_choice names the function {name!r}, which is not in tools "
                                                 f"({names})")
        if choice != "auto" and (body.response_format is not None and body.response_format.type != "text"
                                 or body.structured_outputs is not None):
            raise field_error("tool_choice", f"tool_choice {described(body.tool_choice)} forces the output's shape; "
                                             f"it cannot be combined with response_format or structured_outputs")
        if choice == "auto":
            if parser is None:
                raise field_error("tool_choice", '"auto" tool choice needs the server started with '
                                                 '--enable-auto-tool-choice --tool-call-parser hermes')
            strict = next((i for i, tool in enumerate(body.tools) if tool.function.strict), None)
            if strict is not None:
                raise field_error(f"tools.{strict}.function.strict", 'strict arguments are not enforced with '
                                  'tool_choice "auto" (a parser reads them); name the function or use "required"')
        return cls(body.tools, choice, name, body.parallel_tool_calls, parser)

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar that forces a named or required call (without JSON's optional whitespace, which a small
        model may repeat until it runs out of tokens)."""
        if self.choice == "named":
            tool = next(t for t in self.tools if t.function.name == self.name)
            return StructuredOutputsParams(json=tool.function.parameters or NO_ARGUMENTS, disable_any_whitespace=True)
        if self.choice == "required":
            return StructuredOutputsParams(json=calls_schema(self.tools, self.parallel), disable_any_whitespace=True)
        return None

    def extractor(self):
        if self.choice == "named":
            return NamedCall(self.name)
        if self.choice == "required":
            return RequiredCalls()
        return HermesCalls(self.parallel)

    def shape_message(self, choice: dict) -> dict:
        """A whole reply's choice with its text turned into content and tool calls."""
        extractor = self.extractor()
        content, deltas = extractor.feed(choice["message"]["content"], final=True)
        choice["message"] = {"role": "assistant", "content": content or None, "tool_calls": merged(deltas)}
        choice["finish_reason"] = extractor.finish_reason(choice["finish_reason"])
        return choice

    def chunk_shaper(self) -> "ChunkShaper":
        return ChunkShaper(self)


class ChunkShaper:
    """A streamed reply's chunks with their text turned into content and tool-call deltas (an extractor per
    choice index)."""

    def __init__(self, tool_use: ToolUse):
        self.tool_use, self.extractors = tool_use, {}

    def shape(self, choice: dict) -> dict | None:
        """The choice of one chunk, reshaped; None when nothing is left to send."""
        if choice["index"] not in self.extractors:
            self.extractors[choice["index"]] = self.tool_use.extractor()
        extractor = self.extractors[choice["index"]]
        final = choice["finish_reason"] is not None
        content, deltas = extractor.feed(choice["delta"].get("content") or "", final)
        choice["delta"] = {**({"content": content} if content else {}), **({"tool_calls": deltas} if deltas else {})}
        if final:
            choice["finish_reason"] = extractor.finish_reason(choice["finish_reason"])
        return choice if choice["delta"] or final or choice["logprobs"] else None


def described(choice) -> str:
    return repr(choice.function.name) if isinstance(choice, NamedToolChoice) else repr(choice)


def calls_schema(tools: list[Tool], parallel: bool) -> dict:
    """vLLM's schema for "required": an array of calls, each {"name": one tool's name, "parameters": its
    arguments}; the tools' "$defs" move to the top, where their "#/$defs/..." references point."""
    calls, defs = [], {}
    for tool in tools:
        parameters = dict(tool.function.parameters or NO_ARGUMENTS)
        for name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise field_error("tools", f"tools define '$defs/{name}' twice, differently")
        calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                                       "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return {**schema, "$defs": defs} if defs else schema


def call_start(index: int, name: str) -> dict:
    return {"index": index, "id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": ""}}


def arguments_delta(index: int, arguments: str) -> dict:
    return {"index": index, "function": {"arguments": arguments}}


def merged(deltas: list[dict]) -> list[dict]:
    """Streamed tool-call deltas as whole calls."""
    calls = []
    for delta in deltas:
        if "id" in delta:
            calls.append({**delta, "function": dict(delta["function"])})
            del calls[-1]["index"]
        else:
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
    return calls


class Extractor:
    num_calls = 0

    def finish_reason(self, engine_reason: str) -> str:
        return "tool_calls" if self.num_calls and engine_reason == "stop" else engine_reason


class NamedCall(Extractor):
    """All the text is the arguments of one call to the named function."""

    def __init__(self, name: str):
        self.name = name

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        deltas = [] if self.num_calls else [call_start(0, self.name)]
        self.num_calls = 1
        return "", deltas + ([arguments_delta(0, text)] if text else [])


class RequiredCalls(Extractor):
    """The text is a JSON array of calls (the "required" grammar's); each call is sent once it is complete."""

    def __init__(self):
        self.text, self.position = "", None  # where the next call may start, once "[" is in

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        self.text += text
        deltas = []
        if "}" in text or final:
            for name, arguments in self.complete_calls():
                deltas += [call_start(self.num_calls, name), arguments_delta(self.num_calls, arguments)]
                self.num_calls += 1
        return "", deltas

    def complete_calls(self):
        if self.position is None:
            if "[" not in self.text:
                return
            self.position = self.text.index("[") + 1
        decoder = json.JSONDecoder()
        while True:
            rest = self.text[self.position:]
            call_text = rest.lstrip(" \t\r\n,")
            try:
                call, end = decoder.raw_decode(call_text)
            except json.JSONDecodeError:
                return  # not complete yet
            self.position += len(rest) - len(call_text) + end
            yield call["name"], json.dumps(call["parameters"], ensure_ascii=False)


class HermesCalls(Extractor):
    """Calls written as <tool_call>{"name": ..., "arguments": {...}}</tool_call> in the text. The text outside
    the tags is the content (without its leading and trailing whitespace); a tag whose inside is not such a call
    stays in the content as it was written. Streamed, text that may be the start of a tag is held back until it
    is known; a call is sent once its closing tag is in (or the output ends)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, parallel: bool):
        self.parallel = parallel
        self.pending = ""  # text not yet classified
        self.in_call = False
        self.held_space = ""  # trailing whitespace of the content, sent only if more content follows
        self.content_started = False

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        self.pending += text
        content, deltas = [], []
        while True:
            if self.in_call:
                end = self.pending.find(self.END)
                if end < 0 and not final:
                    break
                inside = self.pending if end < 0 else self.pending[:end]
                self.pending = "" if end < 0 else self.pending[end + len(self.END):]
                self.in_call = False
                call = parse_hermes_call(inside)
                if call is None:
                    content.append(self.START + inside + (self.END if end >= 0 else ""))
                elif self.parallel or not self.num_calls:
                    deltas += [call_start(self.num_calls, call[0]), arguments_delta(self.num_calls, call[1])]
                    self.num_calls += 1
            else:
                start = self.pending.find(self.START)
                if start < 0:
                    keep = 0 if final else partial_tag_length(self.pending, self.START)
                    content.append(self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                content.append(self.pending[:start])
                self.pending = self.pending[start + len(self.START):]
                self.in_call = True
        return self.trimmed("".join(content)), deltas

    def trimmed(self, content: str) -> str:
        content = self.held_space + content
        if not self.content_started:
            content = content.lstrip()
        shown = content.rstrip()
        self.held_space = content[len(shown):]
        self.content_started = self.content_started or bool(shown)
        return shown


def parse_hermes_call(inside: str) -> tuple[str, str] | None:
    """(name, arguments as JSON) of a tag's inside, or None if it is not a call."""
    try:
        call = json.loads(inside)
    except json.JSONDecodeError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)
            and isinstance(call.get("arguments", {}), dict)):
        return None
    return call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)


def partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is the start of ``tag``."""
    return next((n for n in range(min(len(text), len(tag) - 1), 0, -1) if text.endswith(tag[:n])), 0)
