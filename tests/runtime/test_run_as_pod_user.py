"""The runtime as the kubelet runs it: as uid 10001, not as the user who wrote the files
(issue 21: under a real kubelet no termination message was written, and a checkpoint saved by
root was unreadable). Each check runs in a forked child whose real uid and gid are 10001."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from shardline_runtime import termination_log
from shardline_runtime.model_loader.checkpoint_files import CheckpointError

POD_UID = 10001

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching to uid 10001 needs root")


def as_pod_user(fn):
    """``fn()`` in a forked child running as uid/gid 10001; returns its JSON-able result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(POD_UID)
            os.setuid(POD_UID)
            out = {"result": fn()}
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = {"error": f"{type(e).__name__}: {e}"}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


@pytest.fixture
def shared_dir():
    """A directory uid 10001 can enter but not write (like ``/dev`` in a container)."""
    d = Path(tempfile.mkdtemp(prefix="pod-user-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def test_termination_log_is_the_kubelets_file_in_a_read_only_dir(shared_dir, monkeypatch):
    monkeypatch.delenv("SHARDLINE_TERMINATION_LOG", raising=False)
    log = shared_dir / "termination-log"
    log.touch(mode=0o666)
    log.chmod(0o666)  # as the kubelet creates it
    got = as_pod_user(lambda: termination_log.termination_log_path(str(log)))
    assert got == {"result": str(log)}


def test_no_termination_log_where_nothing_is_writable(shared_dir, monkeypatch):
    monkeypatch.delenv("SHARDLINE_TERMINATION_LOG", raising=False)
    got = as_pod_user(lambda: termination_log.termination_log_path(str(shared_dir / "log")))
    assert got == {"result": None}


def test_unreadable_shard_names_the_pods_uid(shared_dir):
    from shardline_runtime.model_loader.checkpoint_files import read_header

    shard = shared_dir / "model.safetensors"
    shard.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    shard.chmod(0o600)  # as save_pretrained leaves it, owned by root

    def read():
        try:
            read_header(shard)
        except CheckpointError as e:
            return str(e)
        return "read"

    assert f"runs as uid {POD_UID}" in as_pod_user(read)["result"]


def test_tiny_checkpoint_files_are_readable_by_the_pod_user(shared_dir):
    from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint

    out = make_tiny_checkpoint(shared_dir / "m", "llama", seed=1, tokenizer=False)
    unreadable = [p.name for p in out.iterdir() if not p.stat().st_mode & 0o004]
    assert unreadable == []


def test_demo_text_revisions_are_readable_by_the_pod_user(shared_dir, monkeypatch):
    # Found by `make demo` on the real node: the demo's trained model is saved with
    # save_pretrained (model.safetensors 0600) and copied to the hostPath as it was, so both
    # ranks failed with CheckpointError as uid 10001 until the restart budget ran out.
    import hack.scenario.text_model as text_model
    from hack.scenario.models import write_text_revisions

    source = shared_dir / "trained" / "rev-a"
    source.mkdir(parents=True)
    shard = source / "model.safetensors"
    shard.write_bytes(b"weights")
    shard.chmod(0o600)
    monkeypatch.setattr(text_model, "ensure_text_model", lambda log: {"rev-a": source})
    target = write_text_revisions(shared_dir / "models", log=lambda line: None)["rev-a"]
    assert as_pod_user(lambda: (target / "model.safetensors").read_text()) == {"result": "weights"}


def test_demo_text_revisions_left_unreadable_by_older_runs_are_fixed(shared_dir, monkeypatch):
    import hack.scenario.text_model as text_model
    from hack.scenario.models import write_text_revisions

    source = shared_dir / "trained" / "rev-a"
    source.mkdir(parents=True)
    (source / "model.safetensors").write_bytes(b"weights")
    monkeypatch.setattr(text_model, "ensure_text_model", lambda log: {"rev-a": source})
    target = write_text_revisions(shared_dir / "models", log=lambda line: None)["rev-a"]
    (target / "model.safetensors").chmod(0o600)  # what the previous demo version left
    write_text_revisions(shared_dir / "models", log=lambda line: None)
    assert as_pod_user(lambda: (target / "model.safetensors").read_text()) == {"result": "weights"}
