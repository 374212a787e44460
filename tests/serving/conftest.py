"""Fixtures: real ``shardline-runtime serve`` processes on tiny checkpoints (loopback only)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from serving_server import CONTEXT, POOL, SMALL_CONTEXT, start_server


@pytest.fixture(scope="session")
def checkpoint_dir():
    """A directory outside pytest's rotating basetemp (concurrent pytest runs on this machine
    prune old basetemps, which would delete a checkpoint under a running server)."""
    path = Path(tempfile.mkdtemp(prefix="shardline-serving-tests-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _checkpoint(root: Path, name: str, seed: int, **overrides) -> Path:
    from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint

    path = root / name
    if not (path / "config.json").exists():
        make_tiny_checkpoint(path, arch="llama", seed=seed, **overrides)
    return path


@pytest.fixture(scope="session")
def spec_target(tiny_checkpoint):
    """The speculative-decoding tests' target: tiny llama (seed 0), 2048 positions."""
    return tiny_checkpoint("llama", 0, max_position_embeddings=2048)


@pytest.fixture(scope="session")
def cycle_target(spec_target, tmp_path_factory):
    """``spec_target`` continuing ``speculative_harness.CYCLE`` (greedy: always; temperature 1:
    about half the time)."""
    from speculative_harness import CYCLE

    from shardline_runtime.tiny_checkpoint import make_cycle_checkpoint

    return make_cycle_checkpoint(spec_target, tmp_path_factory.mktemp("cycle"), CYCLE, 6.2)


@pytest.fixture(scope="session")
def serving_checkpoint(checkpoint_dir):
    """Tiny llama (seed 0) with a 4096-token context: revision A."""
    return _checkpoint(checkpoint_dir, "rev-a", 0, max_position_embeddings=CONTEXT)


@pytest.fixture(scope="session")
def serving_checkpoint_b(checkpoint_dir):
    """Same architecture, other weights (seed 1): revision B."""
    return _checkpoint(checkpoint_dir, "rev-b", 1, max_position_embeddings=CONTEXT)


@pytest.fixture(scope="session")
def server(serving_checkpoint, checkpoint_dir):
    """One shared server: pool 2048 tokens, context 4096, revision ``rev-a``."""
    srv = start_server(serving_checkpoint, checkpoint_dir, "--max-total-tokens", str(POOL),
                       "--revision", "rev-a", "--served-model-name", "tiny-llama")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def small_ctx_server(serving_checkpoint, checkpoint_dir):
    """A server whose context (128) is smaller than its KV pool (1024): the context is the limit."""
    srv = start_server(serving_checkpoint, checkpoint_dir, "--context-length", str(SMALL_CONTEXT),
                       "--max-total-tokens", "1024")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tokenizer(serving_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(serving_checkpoint))


@pytest.fixture(scope="session")
def tools_checkpoint(serving_checkpoint, checkpoint_dir):
    """Revision A's weights with a tokenizer whose chat template renders tools (Hermes style)."""
    from transformers import AutoTokenizer

    from shardline_runtime.tiny_checkpoint import TOOLS_CHAT_TEMPLATE

    path = checkpoint_dir / "tools"
    if not (path / "config.json").exists():
        shutil.copytree(serving_checkpoint, path)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        tokenizer.chat_template = TOOLS_CHAT_TEMPLATE
        tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tools_server(tools_checkpoint, checkpoint_dir):
    """A server on the tools checkpoint reading Hermes ``<tool_call>`` replies (the agent
    clients' tests share it)."""
    srv = start_server(tools_checkpoint, checkpoint_dir, "--max-total-tokens", str(POOL),
                       "--served-model-name", "tiny-tools", "--tool-call-parser", "hermes")
    yield srv
    srv.stop()
