"""Runs ``test_quant_kernels.py`` under Triton's interpreter, in a subprocess, so that
``TRITON_INTERPRET=1`` (which must be set before ``triton`` is imported and turns every Triton
kernel of the process into Python) never reaches the rest of the suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quant_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    path = os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(ROOT), str(ROOT / "runtime"), str(ROOT / "operator")])
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=path)
    proc = subprocess.run(
        # the torch._scaled_mm case is CUDA only (bench/gpu_quant.sh runs it); every Triton one runs here
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-k", "not scaled_mm",
         str(ROOT / "tests" / "runtime" / "test_quant_kernels.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert " passed" in last and "skipped" not in last, proc.stdout[-2000:]
