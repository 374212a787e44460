"""Fixtures: real ``shardline-runtime serve`` processes on tiny checkpoints (loopback only)."""

from __future__ import annotations

import pytest
from serving_server import CONTEXT, POOL, start_server


@pytest.fixture(scope="session")
def serving_checkpoint(tiny_checkpoint):
    """Tiny llama (seed 0) with a 4096-token context."""
    return tiny_checkpoint("llama", 0, max_position_embeddings=CONTEXT)


@pytest.fixture(scope="session")
def serving_checkpoint_b(tiny_checkpoint):
    """Same architecture, other weights (seed 1): revision B."""
    return tiny_checkpoint("llama", 1, max_position_embeddings=CONTEXT)


@pytest.fixture(scope="session")
def server(serving_checkpoint, tmp_path_factory):
    """One shared server: pool 2048 tokens, context 4096, revision ``rev-a``."""
    srv = start_server(serving_checkpoint, tmp_path_factory.mktemp("server"), "--max-total-tokens", str(POOL),
                       "--revision", "rev-a", "--served-model-name", "tiny-llama")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tokenizer(serving_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(serving_checkpoint))
