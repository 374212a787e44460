"""Fixtures for model sources: the Hub double with a tiny checkpoint, and its files."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.model_sources.hub_double import HubDouble, HubRepo


def checkpoint_files(directory: Path) -> dict[str, bytes]:
    """Every file of a checkpoint directory, by its relative path."""
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def hub(monkeypatch, tiny_checkpoint):
    """A running Hub double holding ``shardline/tiny-llama`` (branch ``main`` and tag ``v1``: the
    tiny llama checkpoint); ``HF_ENDPOINT`` points at it, ``HF_TOKEN`` is unset."""
    with HubDouble() as double:
        repo = HubRepo()
        repo.commit(checkpoint_files(Path(tiny_checkpoint("llama"))), ref="main")
        repo.refs["v1"] = repo.refs["main"]
        double.repos["shardline/tiny-llama"] = repo
        monkeypatch.setenv("HF_ENDPOINT", double.endpoint)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        yield double
