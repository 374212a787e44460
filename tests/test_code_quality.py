"""The runtime and operator packages pass the linter, the formatter and the type checker, as
configured in pyproject.toml (``[tool.ruff]``, ``[tool.mypy]``). Each test fails with the tool's
own output, so the message says what to fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["runtime/shardline_runtime", "operator/shardline_operator"]


def run_tool(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"`{' '.join(args)}` failed:\n{proc.stdout}{proc.stderr}"


def test_ruff_lint_passes():
    run_tool("ruff", "check", *PACKAGES)


def test_ruff_format_leaves_the_code_unchanged():
    run_tool("ruff", "format", "--check", *PACKAGES)


@pytest.mark.slow
def test_mypy_finds_no_type_errors():
    run_tool("mypy")  # the files and options are in pyproject.toml
