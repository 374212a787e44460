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


@pytest.fixture(scope="session")
def s3_server():
    """A running versitygw (built once into the Shardline cache) for the whole session."""
    from hack.s3server import S3Server

    with S3Server() as server:
        yield server


@pytest.fixture
def s3(s3_server, monkeypatch, tiny_checkpoint, request):
    """``s3_server`` with a fresh bucket holding the tiny llama checkpoint under ``tiny/v1``;
    the environment points boto3 (and the runtime) at it. Yields ``(server, bucket)``."""
    from shardline_runtime.model_loader.s3_source import s3_client

    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    bucket = "models-" + request.node.name.replace("_", "-")[:40].strip("-").lower()
    client = s3_client()
    client.create_bucket(Bucket=bucket)
    for name, data in checkpoint_files(Path(tiny_checkpoint("llama"))).items():
        client.put_object(Bucket=bucket, Key=f"tiny/v1/{name}", Body=data)
    yield s3_server, bucket
