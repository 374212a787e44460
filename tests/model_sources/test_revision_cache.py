"""The download cache: whole revisions only, resumable partials, the LRU bound."""

from __future__ import annotations

import os

import pytest

from shardline_runtime.model_loader.revision_cache import (
    PARTIAL,
    cached_revisions,
    evict,
    revision_key,
    source_revision,
    stage_revision,
)


def _revision(root, key: str, size: int, last_used: float) -> None:
    (root / key).mkdir(parents=True)
    (root / key / "model.safetensors").write_bytes(b"x" * size)
    os.utime(root / key, (last_used, last_used))


def test_key_joins_source_and_revision_with_safe_characters():
    assert revision_key("s3", "bucket", "a/b c", "etags-1") == "s3--bucket--a--b-c--etags-1"


def test_filled_revision_appears_under_its_key(tmp_path):
    path = stage_revision(tmp_path, "k", lambda d: (d / "f").write_text("x"))
    assert (path / "f").read_text() == "x"


def _fail_halfway(directory):
    (directory / "f").write_text("half")
    raise OSError("disk full")


def test_failed_fill_leaves_no_revision(tmp_path):
    with pytest.raises(OSError):
        stage_revision(tmp_path, "k", _fail_halfway)
    assert not (tmp_path / "k").exists()


def test_failed_fill_keeps_its_partial_for_the_next_try(tmp_path):
    with pytest.raises(OSError):
        stage_revision(tmp_path, "k", _fail_halfway)
    assert (tmp_path / PARTIAL / "k" / "f").read_text() == "half"


def test_present_revision_is_not_filled_again(tmp_path):
    stage_revision(tmp_path, "k", lambda d: (d / "f").write_text("x"))
    calls = []
    stage_revision(tmp_path, "k", calls.append)
    assert calls == []


def test_revisions_are_listed_least_recently_used_first(tmp_path):
    _revision(tmp_path, "new", 10, 2000)
    _revision(tmp_path, "old", 10, 1000)
    assert [r.key for r in cached_revisions(tmp_path)] == ["old", "new"]


def test_eviction_deletes_the_least_recently_used_first(tmp_path):
    _revision(tmp_path, "old", 100, 1000)
    _revision(tmp_path, "mid", 100, 2000)
    _revision(tmp_path, "new", 100, 3000)
    assert evict(tmp_path, max_bytes=200, keep=()) == ["old"]


def test_eviction_never_deletes_a_kept_revision(tmp_path):
    _revision(tmp_path, "served", 100, 1000)
    _revision(tmp_path, "new", 100, 3000)
    evict(tmp_path, max_bytes=0, keep={"served"})
    assert (tmp_path / "served").is_dir()


def test_eviction_stops_once_under_the_bound(tmp_path):
    _revision(tmp_path, "old", 100, 1000)
    _revision(tmp_path, "new", 100, 3000)
    evict(tmp_path, max_bytes=150, keep=())
    assert (tmp_path / "new").is_dir()


def test_staged_revision_records_the_source_it_was_verified_as(tmp_path):
    verified = {"uri": "s3://b/p", "resolvedRevision": "etags-1"}
    path = stage_revision(tmp_path, "k", lambda d: (d / "f").write_text("x"), verified)
    assert source_revision(path) == "etags-1"


def test_a_directory_without_a_record_has_no_source_revision(tmp_path):
    assert source_revision(tmp_path) is None
