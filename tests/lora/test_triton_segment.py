"""The Triton LoRA segment kernel equals the CPU per-adapter path: the kernel alone (segments of
several lengths, base-model gaps, sizes not multiples of the blocks) and a whole model's logits
against transformers + peft. Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1`` in its own
process (``test_triton_segment_interpreter.py`` starts it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA, or TRITON_INTERPRET=1 (run through test_triton_segment_interpreter.py)",
)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))


def test_segment_lora_delta_equals_grouped_reference():
    from shardline_runtime.lora.triton_segment import segment_lora_delta

    g = torch.Generator().manual_seed(0)
    T, d_in, R, slots = 23, 40, 8, 3
    ranges = [(0, 24), (24, 12), (36, 12)]  # q / k / v columns
    x = torch.randn(T, d_in, generator=g)
    y = torch.randn(T, 48, generator=g)
    a = torch.randn(slots, 3 * R, d_in, generator=g)
    b = torch.randn(slots, 48, R, generator=g)
    segments = [(0, 5, 2), (7, 1, 0), (8, 13, 2), (21, 2, 1)]  # (start, len, slot); rows 5-6 are base
    expect = y.clone()
    for start, n, s in segments:
        xa = x[start:start + n] @ a[s].T
        for i, (off, size) in enumerate(ranges):
            expect[start:start + n, off:off + size] += xa[:, i * R:(i + 1) * R] @ b[s, off:off + size].T
    dev = [t.to(DEVICE) for t in (x, y, a, b)]
    seg = tuple(torch.tensor([s[i] for s in segments], dtype=torch.int32, device=DEVICE) for i in (0, 1, 2))
    segment_lora_delta(dev[0], dev[1], dev[2], dev[3], ranges, R, seg, max(s[1] for s in segments))
    assert torch.allclose(dev[1].cpu(), expect, rtol=1e-4, atol=1e-3), (dev[1].cpu() - expect).abs().max()


def test_model_with_segment_kernel_matches_peft(tiny_checkpoint, tmp_path):
    import harness
    from lora_fixtures import make_peft_adapter, peft_logits, run_with_adapters

    base = tiny_checkpoint("llama")
    a = make_peft_adapter(base, tmp_path / "a", r=4, seed=1)
    b = make_peft_adapter(base, tmp_path / "b", r=8, alpha=4, seed=2, target_modules=("q_proj", "v_proj", "down_proj"))
    runner = harness.make_runner(base, device=DEVICE, enable_lora=True, max_lora_rank=8, max_loras_per_batch=2,
                                 lora_paths=(f"a={a}", f"b={b}"), disable_cuda_graph=True)
    runner.lora_manager.segment_kernel = True
    prompts = [[5, 17, 200, 33, 9, 41, 77, 300], [12, 8, 101, 4, 60], [7, 7, 9]]
    names = ["a", None, "b"]
    out1, out2, nxt = run_with_adapters(runner, prompts, names)
    assert runner.lora_manager.batch_info.seg_tensors is not None  # the kernel path ran
    for i, (p, n) in enumerate(zip(prompts, names)):
        if n is None:
            continue
        ref = peft_logits(base, {"a": a, "b": b}[n], p + [nxt[i]])
        assert (out1[i].cpu() - ref[len(p) - 1]).abs().max() <= 1e-3
        assert (out2[i].cpu() - ref[len(p)]).abs().max() <= 1e-3
