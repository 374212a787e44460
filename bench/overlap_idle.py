"""Device idle time between consecutive decode steps, overlap scheduling on and off.

The overlap scheduler (``managers/overlap.py``) prepares step N+1 on the host while step N runs,
so on a GPU the device should go from one decode step's kernels to the next with no gap that the
host's own work explains. This runs the real ``Scheduler`` loop (``run_step``, in-process, rank 0,
outputs captured) over ``--batch-size`` greedy requests decoding together, profiles
``--profile-steps`` steady-state loop iterations with ``torch.profiler`` (CUDA activity), and reads
every device kernel's start and end from the trace. Reported per mode:

- ``step_ms``: wall time per loop iteration in the profiled window;
- ``busy_%``: share of the window covered by kernels (overlapping kernels counted once);
- ``idle_us/step``: the window minus kernel time, per iteration;
- ``gap_p50_us`` / ``gap_max_us``: gaps between the end of one kernel and the start of the next
  (kernels that overlap give no gap); the largest gaps are where the device waited for the host.

On the CPU (``--device cpu``, the dry run) there are no device kernels: the script runs the same
loop and profiler and reports only ``step_ms``.

Usage::

    python bench/overlap_idle.py --device cuda --preset llama-1b --dtype bfloat16 --batch-size 1 8 64
    python bench/overlap_idle.py --device cpu --layers 2 --hidden 64 --heads 4 --kv-heads 2 \
        --intermediate 128 --vocab 512 --batch-size 1 2 --profile-steps 4     # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import PRESETS, add_model_shape_args, make_checkpoint  # noqa: E402

from shardline_runtime.managers.io_struct import TokenizedGenerateReqInput  # noqa: E402
from shardline_runtime.managers.scheduler import Scheduler  # noqa: E402
from shardline_runtime.managers.tp_worker import TpModelWorker  # noqa: E402
from shardline_runtime.sampling.sampling_params import SamplingParams  # noqa: E402
from shardline_runtime.server_args import ServerArgs  # noqa: E402


class _Discard:
    """Rank 0's output socket: the HTTP process is not there; outputs are dropped."""

    def send_pyobj(self, msg) -> None:
        pass


def make_scheduler(path: Path, args, batch_size: int, overlap: bool) -> Scheduler:
    tokens = (args.prompt_len + args.warmup_steps + args.profile_steps + 16) * batch_size + 64
    server_args = ServerArgs(
        model_path=str(path), device=args.device, dtype=args.dtype, max_total_tokens=tokens,
        max_running_requests=max(batch_size, 1), disable_overlap_schedule=not overlap,
        disable_cuda_graph=args.disable_cuda_graph, cuda_graph_max_bs=max(args.batch_size),
        context_length=args.prompt_len + args.warmup_steps + args.profile_steps + 64,
    )
    scheduler = Scheduler(server_args, 0, TpModelWorker(server_args, 0))
    scheduler.sender.socket = _Discard()
    return scheduler


def requests(batch_size: int, args) -> list[TokenizedGenerateReqInput]:
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=args.warmup_steps + args.profile_steps + 8,
                            temperature=0.0, ignore_eos=True)
    return [
        TokenizedGenerateReqInput(rid=f"r{i}", input_ids=torch.randint(3, args.vocab, (args.prompt_len,), generator=g).tolist(),
                                  sampling_params=params)
        for i in range(batch_size)
    ]


def kernel_intervals(trace_path: Path) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every device kernel in a Chrome trace, sorted by start."""
    events = json.loads(trace_path.read_text()).get("traceEvents", [])
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
             for e in events if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel"]
    return sorted(spans)


def idle_figures(spans: list[tuple[float, float]], steps: int) -> dict[str, float]:
    """Busy share, idle time per step and the gaps between kernels of a window of ``steps``."""
    if not spans:
        return {}
    window = spans[-1][1] - spans[0][0]
    busy, gaps, end = 0.0, [], spans[0][0]
    for start, stop in spans:
        if start > end:
            gaps.append(start - end)
            busy += stop - start
        else:
            busy += max(0.0, stop - end)
        end = max(end, stop)
    return {
        "busy_%": 100.0 * busy / window,
        "idle_us/step": (window - busy) / steps,
        "gap_p50_us": statistics.median(gaps) if gaps else 0.0,
        "gap_max_us": max(gaps) if gaps else 0.0,
        "kernels/step": len(spans) / steps,
    }


def measure(path: Path, args, batch_size: int, overlap: bool) -> dict[str, float]:
    scheduler = make_scheduler(path, args, batch_size, overlap)
    scheduler.run_step(requests(batch_size, args))
    for _ in range(args.warmup_steps):
        scheduler.run_step([])
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.profile_steps):
            scheduler.run_step([])
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        figures = idle_figures(kernel_intervals(trace), args.profile_steps)
    figures["step_ms"] = 1e3 * elapsed / args.profile_steps
    while not scheduler.is_idle():
        scheduler.run_step([])
    return figures


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    add_model_shape_args(parser)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--warmup-steps", type=int, default=8)
    parser.add_argument("--profile-steps", type=int, default=32)
    parser.add_argument("--disable-cuda-graph", action="store_true", help="eager decode (default: graphs on CUDA)")
    args = parser.parse_args(argv)
    if args.preset:
        for key, value in PRESETS[args.preset].items():
            setattr(args, key, value)
    args.arch, args.context_len = "llama", args.prompt_len + args.warmup_steps + args.profile_steps + 64
    if args.device == "cpu":
        args.disable_cuda_graph = True
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp) / "model", args)
        columns = ["step_ms", "busy_%", "idle_us/step", "gap_p50_us", "gap_max_us", "kernels/step"]
        print(f"decode idle time, {args.device} {args.dtype}, {args.layers} layers x {args.hidden}, "
              f"prompt {args.prompt_len}, {args.profile_steps} profiled steps, "
              f"graphs {'off' if args.disable_cuda_graph else 'on'}")
        print(f"{'batch':>5} {'overlap':>7} " + " ".join(f"{c:>13}" for c in columns))
        for batch_size in args.batch_size:
            for overlap in (True, False):
                figures = measure(path, args, batch_size, overlap)
                cells = [f"{figures[c]:13.2f}" if c in figures else f"{'n/a':>13}" for c in columns]
                print(f"{batch_size:>5} {'on' if overlap else 'off':>7} " + " ".join(cells))


if __name__ == "__main__":
    main()
