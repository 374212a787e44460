"""Command line: ``shardline-runtime serve [flags]`` (also ``python -m shardline_runtime serve``)
and ``shardline-runtime download [flags]`` (``download_cli.py``: stage a model revision into a
cache directory, as the operator's staging Job does).

The flags of ``serve`` are those of :func:`shardline_runtime.server_args.make_parser`. The first
fatal error line is written to the termination log (``termination_log.py``).
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from shardline_runtime.termination_log import write_termination_log

if TYPE_CHECKING:
    from shardline_runtime.server_args import ServerArgs

USAGE = (
    "usage: shardline-runtime serve --model-path DIR|hf://ORG/NAME|s3://BUCKET/PREFIX [flags]"
    "   (shardline-runtime serve --help)\n"
    "       shardline-runtime download --model-path hf://ORG/NAME|s3://BUCKET/PREFIX "
    "--download-dir DIR"
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardline-runtime`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "download":
        from shardline_runtime.download_cli import main as download

        return download(argv[1:])
    if argv[0] != "serve":
        print(
            f"unknown command {argv[0]!r}; the commands are 'serve' and 'download'\n{USAGE}",
            file=sys.stderr,
        )
        return 2
    from shardline_runtime.server_args import ServerArgs, ServerArgsError

    usage_errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(
            usage_errors
        ):  # argparse's message, for the termination log too
            args = ServerArgs.from_cli(argv[1:])
    except SystemExit as exc:
        sys.stderr.write(usage_errors.getvalue())
        if exc.code not in (0, None):
            lines = usage_errors.getvalue().strip().splitlines()
            # e.g. "shardline-runtime serve: error: argument --pp-size: must be in [1, inf], got 0"
            write_termination_log(
                f"invalid arguments: {lines[-1] if lines else 'see the container log'}"
            )
        raise
    except ServerArgsError as exc:
        print(f"shardline-runtime serve: error: {exc}", file=sys.stderr)
        write_termination_log(f"invalid arguments: {exc}")
        return 2
    try:
        args = fetch_model_args(args)
    except ValueError as exc:  # ModelSourceError: malformed, missing, refused or corrupt
        print(f"shardline-runtime serve: error: {exc}", file=sys.stderr)
        write_termination_log(f"model fetch failed: {exc}")
        return 2 if getattr(exc, "reason", "") == "InvalidModelSource" else 1
    from shardline_runtime.launch import launch_server

    return launch_server(args)


def fetch_model_args(args: ServerArgs) -> ServerArgs:
    """``args`` with a remote ``--model-path`` (hf://, s3://, ORG/NAME) fetched into
    ``--download-dir`` and replaced by the local, verified directory. The served model name
    defaults to the repository id (as vLLM serves ``Org/Name``) or the ``s3://`` reference, and ``--revision`` defaults
    to the resolved commit or S3 listing digest. With ``--download-max-bytes`` the cache is then
    cut to that many bytes, least recently used revisions first, never the one fetched nor a
    draft fetched just before it.

    Raises:
        ModelSourceError: see :func:`shardline_runtime.model_loader.model_source.fetch_model`.
    """
    from shardline_runtime.model_loader.model_source import fetch_to_local, parse_model_source

    args = fetch_draft_args(args)
    source = parse_model_source(args.model_path)
    if not source.is_remote:
        return args
    fetched = fetch_to_local(
        args.model_path,
        args.download_dir,
        revision=args.revision,
        max_bytes=args.download_max_bytes,
        keep=(Path(str(args.speculative_draft_model_path)).name,)
        if args.draft_model_source
        else (),
    )
    return args.replace(
        model_path=str(fetched.path),
        model_source=args.model_path,
        served_model_name=args.served_model_name
        or (source.location if source.scheme == "hf" else str(source)),
        revision=args.revision or fetched.revision,
    )


def fetch_draft_args(args: ServerArgs) -> ServerArgs:
    """``args`` with a remote ``--speculative-draft-model-path`` (hf://, s3://, ORG/NAME) fetched
    into ``--download-dir`` the same way as ``--model-path`` and replaced by the local, verified
    directory (the draft's own cache entry, bounded by ``--download-max-bytes`` like the
    target's).

    Raises:
        ModelSourceError: naming ``--speculative-draft-model-path``; see
            :func:`shardline_runtime.model_loader.model_source.fetch_model`.
    """
    from shardline_runtime.model_loader.model_source import fetch_to_local, parse_model_source

    draft = args.speculative_draft_model_path
    if not draft:
        return args
    if not parse_model_source(draft, field="--speculative-draft-model-path").is_remote:
        return args
    fetched = fetch_to_local(draft, args.download_dir, max_bytes=args.download_max_bytes)
    return args.replace(speculative_draft_model_path=str(fetched.path), draft_model_source=draft)


if __name__ == "__main__":
    sys.exit(main())
