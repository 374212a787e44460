"""Command line: ``shardline-runtime serve [flags]`` (also ``python -m shardline_runtime serve``).

The flags are those of :func:`shardline_runtime.server_args.make_parser`. The first fatal error
line is written to the termination log (env ``SHARDLINE_TERMINATION_LOG``, else
``/dev/termination-log`` when its directory is writable) so Kubernetes (or the node agent)
reports it as the container's ``state.terminated.message``.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

USAGE = "usage: shardline-runtime serve --model-path DIR [flags]   (shardline-runtime serve --help)"
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
_written = False


def termination_log_path() -> str | None:
    """Path the first fatal error line goes to, or ``None`` when there is nowhere writable."""
    path = os.environ.get("SHARDLINE_TERMINATION_LOG")
    if path:
        return path
    directory = os.path.dirname(DEFAULT_TERMINATION_LOG)
    if os.path.isdir(directory) and os.access(directory, os.W_OK):
        return DEFAULT_TERMINATION_LOG
    return None


def write_termination_log(message: str) -> None:
    """Write ``message``'s first line to the termination log; never raises.

    Only the first fatal error counts: nothing is written when this process already wrote one
    or the file already holds a line (e.g. from a scheduler process of the same pod).
    """
    global _written
    if _written:
        return
    _written = True
    path = termination_log_path()
    if path is None:
        return
    line = (message.strip().splitlines() or ["fatal error"])[0][:4000]
    try:
        if os.path.exists(path) and os.path.getsize(path) > 0 and path != DEFAULT_TERMINATION_LOG:
            return
        with open(path, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardline-runtime`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"unknown command {argv[0]!r}; the only command is 'serve'\n{USAGE}", file=sys.stderr)
        return 2
    from shardline_runtime.server_args import ServerArgs, ServerArgsError

    try:
        args = ServerArgs.from_cli(argv[1:])
    except SystemExit as exc:
        if exc.code not in (0, None):
            write_termination_log("invalid arguments: see the container log for the argparse message")
        raise
    except ServerArgsError as exc:
        print(f"shardline-runtime serve: error: {exc}", file=sys.stderr)
        write_termination_log(f"invalid arguments: {exc}")
        return 2
    from shardline_runtime.launch import launch_server

    return launch_server(args)


if __name__ == "__main__":
    sys.exit(main())
