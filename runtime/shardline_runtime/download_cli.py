"""``shardline-runtime download``: stage one model revision into a cache directory.

The operator's staging Job runs it on every node that runs a group before an in-place rollout
pauses the first group (``operator/shardline_operator/staging.py``); a person can run it to
warm a cache. It fetches and verifies exactly as ``serve`` does before loading
(``model_loader/model_source.py``: one directory per resolved revision, written under
``.partial/`` and renamed when complete, resumed after an interruption), and never evicts: the
runtime that serves from the cache evicts, since only it knows what it serves.

Output: progress as JSON lines on stdout (``{"bytesDone", "bytesTotal"}``), and one JSON line
in the termination log (the container's ``state.terminated.message``, which the operator
reads):

- success: ``{"state": "Succeeded", "resolvedRevision", "cacheKey", "bytes", "cached",
  "seconds", "bytesPerSecond"}`` (exit 0; ``cached``: the revision was already complete in the
  cache, nothing was fetched, and ``bytesPerSecond`` is 0);
- failure: ``{"state": "Failed", "reason", "message"}``; exit 3 for a failure that a retry
  cannot fix (``NotFound``, ``Unauthorized``, ``ChecksumMismatch``, ``NotAModel``,
  ``InvalidModelSource``), exit 1 for one it may (``FetchFailed``: network, 5xx, full disk).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from shardline_runtime.termination_log import write_termination_log

EXIT_RETRYABLE = 1
EXIT_PERMANENT = 3
PERMANENT_REASONS = frozenset(
    {"NotFound", "Unauthorized", "ChecksumMismatch", "NotAModel", "InvalidModelSource"}
)
PROGRESS_EVERY_SECONDS = 2.0


def make_parser() -> argparse.ArgumentParser:
    """The ``download`` command's flags (a subset of ``serve``'s model flags, same names)."""
    p = argparse.ArgumentParser(
        prog="shardline-runtime download",
        description="Fetch and verify an hf:// or s3:// model revision into --download-dir.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--model-path", required=True, help="hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX"
    )
    p.add_argument(
        "--download-dir", required=True, help="The cache root (one directory per revision)."
    )
    p.add_argument("--revision", default=None, help="Hub revision when the reference names none.")
    return p


def _emit(record: dict[str, object]) -> None:
    print(json.dumps(record, sort_keys=True), flush=True)


def main(argv: Sequence[str]) -> int:
    """Run the command; returns the exit status (see the module docstring)."""
    args = make_parser().parse_args(list(argv))
    from shardline_runtime.model_loader.errors import ModelSourceError
    from shardline_runtime.model_loader.model_source import fetch_model, parse_model_source

    started = time.monotonic()
    last = [0.0]
    fetched_bytes = [False]  # a cache hit never reports progress

    def progress(done: int, total: int) -> None:
        fetched_bytes[0] = True
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY_SECONDS or done == total:
            last[0] = now
            _emit({"bytesDone": done, "bytesTotal": total})

    try:
        source = parse_model_source(args.model_path)
        if not source.is_remote:
            raise ModelSourceError(
                f"--model-path: {args.model_path!r} is a local directory; download takes "
                "hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX"
            )
        fetched = fetch_model(source, args.download_dir, revision=args.revision, progress=progress)
    except ModelSourceError as exc:
        reason = getattr(exc, "reason", "FetchFailed")
        record = {"state": "Failed", "reason": reason, "message": str(exc)}
        _emit(record)
        write_termination_log(json.dumps(record, sort_keys=True))
        return EXIT_PERMANENT if reason in PERMANENT_REASONS else EXIT_RETRYABLE
    seconds = time.monotonic() - started
    size = sum(f.stat().st_size for f in fetched.path.rglob("*") if f.is_file())
    record = {
        "state": "Succeeded",
        "resolvedRevision": fetched.revision,
        "cacheKey": fetched.path.name,
        "bytes": size,
        "cached": not fetched_bytes[0],
        "seconds": round(seconds, 3),
        "bytesPerSecond": round(size / seconds) if seconds > 0 and fetched_bytes[0] else 0,
    }
    _emit(record)
    write_termination_log(json.dumps(record, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
