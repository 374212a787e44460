"""Chart test fixtures: the real helm CLI (from PATH or the local-cluster build cache)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "charts" / "shardline"


def find_helm() -> str | None:
    """helm on PATH, else the one hack/localcluster/build.py builds into ~/.cache/shardline/."""
    found = shutil.which("helm")
    if found:
        return found
    try:
        from hack.localcluster.build import bin_dir
    except ImportError:
        return None
    candidate = bin_dir() / "helm"
    return str(candidate) if candidate.exists() else None


@pytest.fixture(scope="session")
def helm():
    """``helm(*args) -> CompletedProcess`` (text, checked); skips when no helm binary exists."""
    binary = find_helm()
    if binary is None:
        pytest.skip("helm CLI not found on PATH or in the local-cluster cache; build it with "
                    "`python3 -m hack.localcluster build`")

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([binary, *args], capture_output=True, text=True, timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    return run
