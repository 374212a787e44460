"""Runs ``test_triton_attention.py``, ``test_triton_rms_norm.py``, ``test_triton_silu_and_mul.py``, ``test_triton_rope_kv.py`` and ``test_rope_kv_wiring.py`` under Triton's interpreter, in a subprocess.

``TRITON_INTERPRET=1`` must be set before ``triton`` is imported, and it must not reach the rest
of the suite (it would turn every Triton kernel in the process into Python), so the kernel tests
get a process of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    path = os.pathsep.join([str(ROOT), str(ROOT / "runtime"), str(ROOT / "operator"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         str(ROOT / "tests" / "runtime" / "test_triton_attention.py"),
         str(ROOT / "tests" / "runtime" / "test_triton_rms_norm.py"),
         str(ROOT / "tests" / "runtime" / "test_triton_silu_and_mul.py"),
         str(ROOT / "tests" / "runtime" / "test_triton_rope_kv.py"),
         str(ROOT / "tests" / "runtime" / "test_rope_kv_wiring.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
