"""The download cache: one directory per resolved revision, complete or absent.

Layout under the cache root (``--download-dir``, or the staging volume)::

    <root>/<key>/             a complete, verified revision (a reader never sees less)
    <root>/.partial/<key>/    a revision being fetched; kept on failure, so the next try resumes
    <root>/.locks/<key>.lock  held (flock) by the one process fetching <key>
    <root>/<key>/.shardline-source.json   {"uri", "resolvedRevision"}: what was verified

``key`` names the source and its resolved revision (``hf--org--name--<commit>``,
``s3--bucket--prefix--etags-<digest>``), so two deployments of one revision share one copy. A
revision's directory modification time is its last use (set on every hit), which the LRU bound
(:func:`evict`) orders by. The write-then-rename scheme is KServe's and OME's model-cache rule: a
directory appears only when whole.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

PARTIAL = ".partial"
LOCKS = ".locks"
SOURCE_FILE = ".shardline-source.json"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def revision_key(*parts: str) -> str:
    """A cache directory name from the source's parts and its resolved revision
    (``revision_key("hf", "Org/Name", commit)`` -> ``hf--Org--Name--<commit>``)."""
    return "--".join(_UNSAFE.sub("-", p.replace("/", "--")).strip("-") for p in parts if p)


def stage_revision(
    root: Path, key: str, fill: Callable[[Path], None], source: Mapping[str, str] | None = None
) -> Path:
    """Return ``root/key``, filling it first when absent.

    ``fill(partial_dir)`` writes (or resumes writing) the revision into ``root/.partial/key`` and
    raises on any failure; on success ``source`` (``{"uri", "resolvedRevision"}``) is written to
    :data:`SOURCE_FILE` in it and the directory is renamed to ``root/key`` in one step. One
    process fills a key at a time (an exclusive ``flock``); a second waits, then finds it done.

    Raises:
        whatever ``fill`` raises (the partial directory is kept for the next try).
    """
    final = root / key
    if final.is_dir():
        touch(final)
        return final
    (root / PARTIAL).mkdir(parents=True, exist_ok=True)
    (root / LOCKS).mkdir(parents=True, exist_ok=True)
    with open(root / LOCKS / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_dir():  # filled by the process we waited for
            touch(final)
            return final
        partial = root / PARTIAL / key
        partial.mkdir(exist_ok=True)
        fill(partial)
        if source is not None:
            (partial / SOURCE_FILE).write_text(json.dumps(dict(source), sort_keys=True))
        os.rename(partial, final)
    return final


def source_revision(model_dir: str | Path) -> str | None:
    """The resolved source revision (Hub commit, S3 listing digest ``etags-...``) recorded in
    a cache revision directory when it was verified; None for any other directory (a local
    model, a revision cached before the record existed, an unreadable record)."""
    try:
        record = json.loads((Path(model_dir) / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    value = record.get("resolvedRevision") if isinstance(record, dict) else None
    return value if isinstance(value, str) and value else None


def touch(path: Path) -> None:
    """Mark a cached revision as used now (its LRU position)."""
    os.utime(path)


@dataclass(frozen=True)
class CachedRevision:
    """One complete revision in the cache: ``key``, ``bytes`` on disk, ``last_used`` (epoch s)."""

    key: str
    bytes: int
    last_used: float


def cached_revisions(root: Path) -> list[CachedRevision]:
    """The complete revisions under ``root``, least recently used first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
        found.append(CachedRevision(entry.name, size, entry.stat().st_mtime))
    return sorted(found, key=lambda r: r.last_used)


def evict(root: Path, max_bytes: int, keep: Iterable[str]) -> list[str]:
    """Delete least recently used revisions until the cache holds at most ``max_bytes``, never
    one in ``keep`` (the revisions groups serve and the one being staged). Returns the deleted
    keys; the cache may stay above the bound when only kept revisions remain."""
    kept = set(keep)
    revisions = cached_revisions(root)
    total = sum(r.bytes for r in revisions)
    deleted = []
    for revision in revisions:
        if total <= max_bytes:
            break
        if revision.key in kept:
            continue
        shutil.rmtree(root / revision.key)
        total -= revision.bytes
        deleted.append(revision.key)
    return deleted
