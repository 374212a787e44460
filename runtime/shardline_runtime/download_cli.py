"""``shardline-runtime download``: stage one model revision into a cache directory.

The operator's staging Job runs it on every node that runs a group before an in-place rollout
pauses the first group (``operator/shardline_operator/staging.py``); a person can run it to
warm a cache. It fetches and verifies exactly as ``serve`` does before loading
(``model_loader/model_source.py``: one directory per resolved revision, written under
``.partial/`` and renamed when complete, resumed after an interruption), and never evicts: the
runtime that serves from the cache evicts, since only it knows what it serves.

Output: progress as JSON lines on stdout (``{"bytesDone", "bytesTotal", "bytesPerSecond"}``,
every 2 s); the same progress as an annotation on the Job's own pod, every 5 s, when it runs in
a pod with API access (``pod_progress.py``: the operator shows it in ``status.staging`` while
the Job runs); and one JSON line in the termination log (the container's
``state.terminated.message``, which the operator reads):

- success: ``{"state": "Succeeded", "resolvedRevision", "cacheKey", "bytes", "cached",
  "seconds", "bytesPerSecond"}`` (exit 0; ``cached``: the revision was already complete in the
  cache, nothing was fetched, and ``bytesPerSecond`` is 0); with ``--draft-model-path`` (the
  draft model's or EAGLE head's hf:// or s3:// uri, fetched after the model into the same cache)
  also ``"draftResolvedRevision"`` and ``"draftCacheKey"``, ``bytes`` counting both;
- failure: ``{"state": "Failed", "reason", "message"}``; exit 3 for a failure that a retry
  cannot fix (``NotFound``, ``Unauthorized``, ``ChecksumMismatch``, ``NotAModel``,
  ``InvalidModelSource``, ``InvalidArgument``), exit 1 for one it may (``FetchFailed``: network, 5xx, full disk).
  A draft's failure has the same reasons, its message beginning ``--draft-model-path <uri>:``.

``--max-bytes-per-second`` (or ``SHARDLINE_DOWNLOAD_MAX_BYTES_PER_SECOND``, which a deployment
sets through ``spec.runtime.env``) caps the average rate, so staging on a node that serves does
not take its whole network link. It paces S3 downloads (per 1 MiB read); Hub downloads are not
paced (``huggingface_hub`` reads whole files itself and reports only at the start and the end).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shardline_runtime.pod_progress import PodAnnotator
from shardline_runtime.termination_log import write_termination_log

if TYPE_CHECKING:
    from shardline_runtime.model_loader.model_source import ModelSource

EXIT_RETRYABLE = 1
EXIT_PERMANENT = 3
PERMANENT_REASONS = frozenset(
    {
        "NotFound",
        "Unauthorized",
        "ChecksumMismatch",
        "NotAModel",
        "InvalidModelSource",
        "InvalidArgument",
    }
)
PROGRESS_EVERY_SECONDS = 2.0
MAX_RATE_ENV = "SHARDLINE_DOWNLOAD_MAX_BYTES_PER_SECOND"


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
    p.add_argument(
        "--draft-model-path",
        default=None,
        help="A draft model's hf:// or s3:// reference, fetched after --model-path.",
    )
    p.add_argument(
        "--max-bytes-per-second",
        type=_positive_int,
        default=None,
        help=f"Cap on the average download rate in bytes/s (default: ${MAX_RATE_ENV}, or none).",
    )
    return p


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer (bytes/s), got {text!r}")
    return value


class _Pace:
    """Progress bookkeeping: the average rate since the first byte, the optional rate cap
    (sleeps until the average is back under it), and where progress goes (stdout lines, the
    pod annotation)."""

    def __init__(self, cap: int | None, annotator: PodAnnotator | None) -> None:
        self.cap, self.annotator = cap, annotator
        self.started: float | None = None
        self.first_done = 0
        self.last_line = 0.0
        self.fetched = False  # a cache hit never reports progress

    def rate(self, done: int) -> int:
        elapsed = time.monotonic() - self.started if self.started is not None else 0.0
        return round((done - self.first_done) / elapsed) if elapsed > 0 else 0

    def __call__(self, done: int, total: int) -> None:
        self.fetched = True
        if self.started is None:
            self.started, self.first_done = time.monotonic(), done
        if self.cap is not None and done < total:  # nothing left to pace at the end
            ahead = (done - self.first_done) / self.cap - (time.monotonic() - self.started)
            if ahead > 0:
                time.sleep(ahead)
        rate = self.rate(done)
        now = time.monotonic()
        if now - self.last_line >= PROGRESS_EVERY_SECONDS or done == total:
            self.last_line = now
            _emit({"bytesDone": done, "bytesTotal": total, "bytesPerSecond": rate})
        if self.annotator is not None and (rate > 0 or done == total):  # a rate from the 2nd call
            self.annotator.report(done, total, rate, force=done == total)


def _emit(record: dict[str, object]) -> None:
    print(json.dumps(record, sort_keys=True), flush=True)


def _fail(reason: str, message: str) -> int:
    """Report a failure (stdout and the termination log); returns the exit status."""
    record: dict[str, object] = {"state": "Failed", "reason": reason, "message": message}
    _emit(record)
    write_termination_log(json.dumps(record, sort_keys=True))
    return EXIT_PERMANENT if reason in PERMANENT_REASONS else EXIT_RETRYABLE


def _remote(text: str, flag: str) -> ModelSource:
    """``text`` parsed as an hf:// or s3:// reference.

    Raises:
        ModelSourceError: malformed, or a local directory (naming ``flag``).
    """
    from shardline_runtime.model_loader.errors import ModelSourceError
    from shardline_runtime.model_loader.model_source import parse_model_source

    source = parse_model_source(text, flag)
    if not source.is_remote:
        raise ModelSourceError(
            f"{flag}: {text!r} is a local directory; download takes "
            "hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX"
        )
    return source


def main(argv: Sequence[str]) -> int:
    """Run the command; returns the exit status (see the module docstring)."""
    args = make_parser().parse_args(list(argv))
    from shardline_runtime.model_loader.errors import ModelSourceError
    from shardline_runtime.model_loader.model_source import fetch_model

    started = time.monotonic()
    cap = args.max_bytes_per_second
    if cap is None and os.environ.get(MAX_RATE_ENV):
        try:
            cap = _positive_int(os.environ[MAX_RATE_ENV])
        except argparse.ArgumentTypeError as exc:
            return _fail("InvalidArgument", f"{MAX_RATE_ENV}: {exc}")
    progress = _Pace(cap, PodAnnotator.from_environment())
    try:
        fetched = fetch_model(
            _remote(args.model_path, "--model-path"),
            args.download_dir,
            revision=args.revision,
            progress=progress,
        )
    except ModelSourceError as exc:
        return _fail(getattr(exc, "reason", "FetchFailed"), str(exc))
    draft = None
    if args.draft_model_path:
        try:  # its own progress (the pod annotation then shows the draft's bytes)
            draft = fetch_model(
                _remote(args.draft_model_path, "--draft-model-path"),
                args.download_dir,
                progress=_Pace(cap, progress.annotator),
            )
        except ModelSourceError as exc:
            message = f"--draft-model-path {args.draft_model_path}: {exc}"
            return _fail(getattr(exc, "reason", "FetchFailed"), message)
    seconds = time.monotonic() - started
    paths = [fetched.path] + ([draft.path] if draft is not None else [])
    size = sum(f.stat().st_size for path in paths for f in path.rglob("*") if f.is_file())
    record: dict[str, object] = {
        "state": "Succeeded",
        "resolvedRevision": fetched.revision,
        "cacheKey": fetched.path.name,
        "bytes": size,
        "cached": not progress.fetched,
        "seconds": round(seconds, 3),
        "bytesPerSecond": round(size / seconds) if seconds > 0 and progress.fetched else 0,
    }
    if draft is not None:
        record.update(draftResolvedRevision=draft.revision, draftCacheKey=draft.path.name)
    _emit(record)
    write_termination_log(json.dumps(record, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
