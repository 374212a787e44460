"""Host work per decode step: the time the scheduler loop spends outside the model forward.

``bench/engine.py --host-overhead`` runs this. Each measurement is a child process that imports
the runtime of one source tree (this one, and with ``--baseline-tree PATH`` another checkout, e.g.
``git archive main | tar -x -C /tmp/base``), builds the real ``Scheduler`` over a
``TpModelWorker`` (rank 0, outputs pickled as the ZMQ socket would, then dropped), lets
``--batch-size``-many requests reach steady decode, and times ``--decode-steps`` loop iterations
(``Scheduler.run_step`` + ``send_stats``, the default overlap loop). Timers wrap methods every
tree has, on the instances, so the same harness measures both trees:

- ``forward``: ``ModelRunner.forward`` (the model; graph replay on CUDA, synchronised there);
- ``sample``: ``ModelRunner.sample`` (sampling and its bookkeeping);
- ``schedule``: ``Scheduler.get_next_batch_to_run`` (policy, KV slots, ``prepare_for_decode``);
- ``build``: ``TpModelWorker.forward_batch_generation`` minus forward and sample (the
  ``ModelWorkerBatch`` -> ``ForwardBatch``, attention metadata);
- ``process``: ``ResultProcessor.process`` (tokens appended, finish checks, KV release, the
  per-step output message built and pickled);
- ``other``: the rest of the iteration (loop glue, launch, copy and wait, stats);
- ``host``: everything but ``forward``: the figure the issue's target is about.

Figures are per decode step in microseconds, the median over ``--repeats`` child runs (the trees
interleaved). With ``--clock cpu --threads 1`` time spent waiting for a busy CPU is not counted.
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path

PARTS = ["host", "schedule", "build", "sample", "process", "other", "forward"]
_HERE = Path(__file__).resolve()


def run(args, checkpoint: Path) -> None:
    """Measure this tree (and ``args.baseline_tree``) and print the table side by side."""
    trees = [("this tree", _HERE.parents[1])]
    if args.baseline_tree:
        trees.insert(0, ("baseline", Path(args.baseline_tree).resolve()))
    samples: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.repeats):
        for label, tree in trees:
            for figures in _child(tree, checkpoint, args):
                samples.setdefault((label, figures["batch"]), []).append(figures)
    print(f"\nhost work per decode step (us; median of {args.repeats}), {args.layers} layers x {args.hidden}, "
          f"vocab {args.vocab}, {args.device} {args.dtype}, {args.clock} clock, prompt {args.prompt_len}, "
          f"{args.decode_steps} steps")
    labels = [label for label, _ in trees]
    print("| batch | part | " + " | ".join(labels) + (" | ratio |" if len(labels) == 2 else " |"))
    print("|---:|---|" + "---:|" * (len(labels) + (len(labels) == 2)))
    for batch in args.host_batch_sizes:
        for part in PARTS:
            values = [statistics.median(f[part] for f in samples[(label, batch)]) for label in labels]
            ratio = f" | {values[1] / values[0]:.2f}" if len(values) == 2 and values[0] else ""
            print(f"| {batch} | {part} | " + " | ".join(f"{v:.0f}" for v in values) + ratio + " |")


def _child(tree: Path, checkpoint: Path, args) -> list[dict]:
    command = [sys.executable, str(_HERE), "--tree", str(tree), "--model", str(checkpoint),
               "--device", args.device, "--dtype", args.dtype, "--prompt-len", str(args.prompt_len),
               "--decode-steps", str(args.decode_steps), "--clock", args.clock,
               "--threads", str(args.threads or 0), "--batch-sizes", *map(str, args.host_batch_sizes)]
    env = dict(os.environ, PYTHONPATH=f"{tree / 'runtime'}:{tree}")
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


class _Timers:
    def __init__(self, clock):
        self.clock = clock
        self.total: dict[str, float] = {}

    def wrap(self, owner, name: str, key: str, sync=None) -> None:
        real = getattr(owner, name)

        def timed(*a, **kw):
            start = self.clock()
            try:
                return real(*a, **kw)
            finally:
                if sync is not None:
                    sync()
                self.total[key] = self.total.get(key, 0.0) + self.clock() - start

        setattr(owner, name, timed)


class _PickleAndDrop:
    """Rank 0's output socket: pickles each message as ``send_pyobj`` does, then drops it."""

    def send_pyobj(self, msg) -> None:
        pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def _measure(batch_size: int, opts) -> dict:
    import torch

    from shardline_runtime.managers.io_struct import TokenizedGenerateReqInput
    from shardline_runtime.managers.scheduler import Scheduler
    from shardline_runtime.managers.tp_worker import TpModelWorker
    from shardline_runtime.sampling.sampling_params import SamplingParams
    from shardline_runtime.server_args import ServerArgs

    warmup = 8
    context = opts.prompt_len + warmup + opts.decode_steps + 16
    server_args = ServerArgs(model_path=opts.model, device=opts.device, dtype=opts.dtype,
                             max_total_tokens=context * batch_size + 64, max_running_requests=batch_size,
                             context_length=context + 64, disable_cuda_graph=opts.device == "cpu")
    scheduler = Scheduler(server_args, 0, TpModelWorker(server_args, 0))
    scheduler.sender.socket = _PickleAndDrop()
    g = torch.Generator().manual_seed(batch_size)
    params = SamplingParams(max_new_tokens=warmup + opts.decode_steps + 8, temperature=0.0, ignore_eos=True)
    vocab = scheduler.worker.model_config.vocab_size
    reqs = [TokenizedGenerateReqInput(rid=f"r{i}", input_ids=torch.randint(3, vocab, (opts.prompt_len,), generator=g).tolist(),
                                      sampling_params=params) for i in range(batch_size)]
    scheduler.run_step(reqs)
    for _ in range(warmup):
        scheduler.run_step([])
        scheduler.send_stats()
    clock = time.process_time if opts.clock == "cpu" else time.perf_counter
    sync = torch.cuda.synchronize if opts.device == "cuda" else None
    timers = _Timers(clock)
    runner = scheduler.worker.model_runner
    timers.wrap(runner, "forward", "forward", sync)
    timers.wrap(runner, "sample", "sample")
    timers.wrap(scheduler.worker, "forward_batch_generation", "worker")
    timers.wrap(scheduler, "get_next_batch_to_run", "schedule")
    timers.wrap(scheduler.results, "process", "process")
    start = clock()
    for _ in range(opts.decode_steps):
        scheduler.run_step([])
        scheduler.send_stats()
    if sync is not None:
        sync()
    total = clock() - start
    t = {k: v / opts.decode_steps * 1e6 for k, v in timers.total.items()}
    step = total / opts.decode_steps * 1e6
    build = t["worker"] - t["forward"] - t["sample"]
    return {"batch": batch_size, "step": step, "forward": t["forward"], "host": step - t["forward"],
            "schedule": t["schedule"], "build": build, "sample": t["sample"], "process": t["process"],
            "other": step - t["schedule"] - t["worker"] - t["process"]}


def _child_main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--clock", default="wall")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    opts = parser.parse_args(argv)
    sys.path.insert(0, str(Path(opts.tree) / "runtime"))
    import torch

    if opts.threads:
        torch.set_num_threads(opts.threads)
    for batch_size in opts.batch_sizes:
        print(json.dumps(_measure(batch_size, opts)), flush=True)


if __name__ == "__main__":
    _child_main(sys.argv[1:])
