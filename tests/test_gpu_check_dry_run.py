"""``bench/gpu_check.sh``'s CPU dry run (``GPU_CHECK_DRY_RUN=1``) of its graph-modes, serving and
kernel-paths steps (``GPU_CHECK_STEPS="modes serving kernels"``; the Triton kernels run under the interpreter in
their own tests): each runs on CPU tensors at tiny sizes, so a change that breaks the prepared
check fails here, where no GPU is lent. One run; each test reads one fact of its output."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def dry_run() -> tuple[int, str]:
    env = dict(os.environ, GPU_CHECK_DRY_RUN="1", GPU_CHECK_STEPS="modes serving kernels", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    return proc.returncode, proc.stdout + proc.stderr


def _rows(output: str, key: str) -> list[dict]:
    rows = []
    for line in output.splitlines():
        if line.startswith("{") and f'"{key}"' in line:
            rows.append(json.loads(line))
    return rows


def test_the_gpu_check_runs_every_step_by_default():
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    assert 'GPU_CHECK_STEPS:-tests triton table modes serving idle quant kernels spec' in script


def test_the_gpu_check_step_caps_fit_in_nine_minutes():
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    caps = [int(n) for n in re.findall(r'timeout "\$\(cap (\d+)\)"', script)]
    assert sum(caps) <= 540, caps


def test_the_gpu_check_runs_the_fused_rotary_kernel():
    assert "tests/runtime/test_triton_rope_kv.py" in (ROOT / "bench" / "gpu_check.sh").read_text()


def test_the_dry_run_passes(dry_run):
    assert dry_run[0] == 0, dry_run[1][-6000:]


@pytest.mark.parametrize("step", ["== graphs in every mode", "== serving on cpu", "== decode kernel paths on cpu"])
def test_the_dry_run_runs_every_step(dry_run, step):
    assert step in dry_run[1]


def test_the_graph_modes_step_measures_every_mode(dry_run):
    assert [r["row"] for r in _rows(dry_run[1], "row")] == ["prefill", "fp8-kv bs1 ctx64", "lora bs1", "recorder bs1"]


def test_the_graph_modes_step_reports_why_nothing_was_captured_on_cpu(dry_run):
    assert {r["captured"]["reason"] for r in _rows(dry_run[1], "row")} == {"cpu: no CUDA graphs"}


def test_the_serving_step_serves_with_overlap_on_and_off(dry_run):
    backends = [(r["backend"], r["concurrency"]) for r in _rows(dry_run[1], "backend")]
    assert backends == [("shardline", 1), ("shardline-no-overlap", 1), ("shardline", 2), ("shardline-no-overlap", 2)]


@pytest.mark.parametrize("metric", ["output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"])
def test_the_serving_step_reports_each_metric(dry_run, metric):
    assert all(r.get(metric) is not None for r in _rows(dry_run[1], "backend")), metric


def test_the_kernel_paths_step_compares_eager_with_torch_compile(dry_run):
    assert "| context | batch | eager | compile | compile / eager |" in dry_run[1]
