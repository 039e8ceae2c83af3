"""``nanoengine COMMAND``: the package's command line, one subcommand per entry point.

    nanoengine serve [MODEL] [--port N] [options]     the OpenAI-compatible server (nanoengine/serve/)
    nanoengine prefix-report REQUESTS.jsonl [options]  where a prompt template breaks prefix-cache reuse
    nanoengine cpu-info [--json]                       the CPU, and what the kernels were built for

Each command is imported only when it runs, so ``prefix-report`` never loads the server.
"""

import sys

USAGE = """usage: nanoengine serve [MODEL] [--port N] [options]  (see nanoengine serve --help)
       nanoengine prefix-report REQUESTS.jsonl [--model DIR] [options]
       nanoengine cpu-info [--json]"""


def main(argv: list[str] | None = None) -> int:
    command, *rest = (sys.argv[1:] if argv is None else argv) or [""]
    if command == "serve":
        from nanoengine.serve.cli import serve
        return serve(rest)
    if command == "prefix-report":
        from nanoengine.tools.prefix_report import main as prefix_report
        return prefix_report(rest)
    if command == "cpu-info":
        from nanoengine.tools.cpu_info import main as cpu_info  # it builds the kernels: only when asked
        return cpu_info(rest)
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
