"""Cost of the expert-distribution recorder on a CPU decode step (side by side, one process).

Three variants of the same TpModelWorker on a tiny Qwen3-MoE, interleaved per repeat:

- ``detached``: no recorder at all (the layers' ``recorder`` attribute is None and the
  ModelRunner has no ``eplb_manager``): the code path of a build without the feature;
- ``off``: the recorder attached but not recording (what every MoE server runs);
- ``stat``: recording in ``stat`` mode.

Reports the best and median decode-step time of each and the ratios to ``detached``.

Usage::

    python bench/moe_recorder.py --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine  # noqa: E402  (bench/engine.py: worker, prompts, timing helpers)


def set_variant(worker, manager, variant: str) -> None:
    runner = worker.model_runner
    for layer in manager.layers:
        layer.recorder = None if variant == "detached" else manager.recorder
    runner.eplb_manager = None if variant == "detached" else manager
    if variant == "stat":
        manager.recorder.start("stat")
    else:
        manager.recorder.stop()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"])
    cli = parser.parse_args(argv)
    if cli.threads:
        torch.set_num_threads(cli.threads)
    engine._clock = {"wall": time.perf_counter, "cpu": time.process_time}[cli.clock]
    args = argparse.Namespace(
        arch="qwen3_moe", layers=cli.layers, hidden=cli.hidden, heads=8, kv_heads=8, intermediate=4 * cli.hidden,
        experts=cli.experts, top_k=2, moe_intermediate=cli.hidden, vocab=8000, dtype="float32", device="cpu",
        batch_size=cli.batch_size, prefill_batch=4, prompt_len=64, decode_steps=cli.decode_steps,
        context_len=512, graph_batch_sizes=[1],
    )
    with tempfile.TemporaryDirectory() as tmp:
        worker = engine.make_worker(engine.make_checkpoint(Path(tmp), args), args)
    manager = worker.model_runner.eplb_manager
    prompts = engine.prompts(cli.batch_size, args.prompt_len, args.vocab, seed=2)
    times: dict[str, list[float]] = {"detached": [], "off": [], "stat": []}
    for repeat in range(cli.repeats + 1):  # the first round warms up and is dropped
        for variant in times:
            set_variant(worker, manager, variant)
            _, _, batch = engine.engine_prefill(worker, prompts)
            step, _ = engine.engine_decode(worker, batch, cli.decode_steps)
            if repeat:
                times[variant].append(step)
    recorded = int(manager.recorder.physical_counts().sum())
    print(f"\nqwen3_moe {cli.layers} layers x {cli.hidden}, {cli.experts} experts, top 2; decode batch {cli.batch_size}, "
          f"{torch.get_num_threads()} threads, {cli.clock} clock; tokens recorded in the last stat round: {recorded}")
    print("| recorder | best (ms) | median (ms) | best / detached | median / detached |")
    print("|---|---:|---:|---:|---:|")
    base_best, base_median = min(times["detached"]), statistics.median(times["detached"])
    for variant, values in times.items():
        best, median = min(values), statistics.median(values)
        print(f"| {variant} | {best * 1e3:.2f} | {median * 1e3:.2f} | {best / base_best:.3f} | {median / base_median:.3f} |")


if __name__ == "__main__":
    main()
