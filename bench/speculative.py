"""Speculative decoding benchmark: acceptance and target steps per output token, per proposer,
on a repetitive and a non-repetitive prompt set, against no speculation, in one run.

Each configuration runs the real scheduler in-process (``Scheduler`` over a ``TpModelWorker``,
no overlap, greedy, ``ignore_eos``) on one randomly initialised Llama (``--layers``,
``--hidden``; vocabulary 512, CPU float32 by default):

- ``repetitive``: each prompt is a random span of ``--span`` tokens repeated ``--repeats``
  times (the shape of code edits, quoting and templated text that prompt lookup targets);
- ``non-repetitive``: random tokens of the same total length;

on two models: ``random`` (the random Llama as is) and ``copying`` (the same checkpoint made to
continue a 16-token cycle, ``tiny_checkpoint.make_cycle_checkpoint``; its repetitive prompts are
that cycle, so it shows what prompt lookup gives a model that copies its context).

Proposers: ``none``, ``NGRAM`` (prompt lookup), ``STANDALONE`` with a layer-skip draft: the
target's first ``--draft-layers`` decoder layers with its embeddings and LM head
(``tiny_checkpoint.make_draft_checkpoint``), run by its own runner and KV pool, and ``EAGLE``
with a one-layer EAGLE head (``speculative/eagle_checkpoint.py``): on ``random`` an untrained
head of random weights (its acceptance is what chance gives: no head is trained here), on
``copying`` the head built to predict the cycle's next feature from the target's hidden state
(``make_cycle_eagle_checkpoint``: what a head that learned the target's features gives), and
``EAGLE3`` with an EAGLE-3 head (``fc`` over three of the target's layers, SGLang's default
layers, and a 64-id draft vocabulary mapped by ``d2t``): random on ``random``, on ``copying``
the head built to advance the cycle one step per pass (``make_cycle_eagle3_checkpoint``).

Columns: ``accept len`` = tokens a request gains per verify step (kept drafts + 1; SGLang's
accept length), ``accept rate`` = kept / proposed draft tokens, ``target steps / token`` =
target forwards (prefill included) per output token, ``ms / step`` = time per target
forward (the draft's forwards included in the time), ``ms / token`` = time per output token (process CPU time, ``--threads`` 1 by default,
so other load on a shared machine does not count), at batch 1 (requests one after another)
and batch 8 (all at once). Greedy outputs with and without speculation are checked to be equal.
A random model continues a repeated span only when its own argmax happens to (it often falls
into loops of its own, which prompt lookup also catches), so the acceptance here is a floor;
the step counts are exact for what was accepted.

Usage::

    python bench/speculative.py                    # about a minute on 2 busy cores
    python bench/speculative.py --device cuda --layers 16 --hidden 2048   # on a GPU
    python bench/speculative.py --device cuda --graphs --clock wall --models copying \
        --prompt-sets repetitive --layers 8 --hidden 1024   # bench/gpu_check.sh's spec step

``tokens / s`` is output tokens per second of the whole run (prefill included), ``vs none`` the
ratio of ``ms / token`` without speculation to this row's, in one run; ``--graphs`` prints what
each configuration really captured (``CapturedGraphs``: decode, verify and draft batch sizes).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from shardline_runtime.managers.io_struct import BatchTokenOut, TokenizedGenerateReqInput
from shardline_runtime.managers.scheduler import Scheduler
from shardline_runtime.managers.tp_worker import TpModelWorker
from shardline_runtime.sampling.sampling_params import SamplingParams
from shardline_runtime.server_args import ServerArgs
from shardline_runtime.speculative.eagle_checkpoint import (
    make_cycle_eagle3_checkpoint,
    make_cycle_eagle_checkpoint,
    make_eagle3_checkpoint,
    make_eagle_checkpoint,
)
from shardline_runtime.tiny_checkpoint import (
    make_cycle_checkpoint,
    make_draft_checkpoint,
    make_tiny_checkpoint,
)

PROPOSERS = (None, "NGRAM", "STANDALONE", "EAGLE", "EAGLE3")
CYCLE = list(range(11, 11 + 16))


class _Capture:
    def __init__(self):
        self.messages = []

    def send_pyobj(self, msg):
        self.messages.append(msg)


def prompt_sets(n: int, span: int, repeats: int, copying: bool, seed: int = 0) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    rep = []
    for _ in range(n):
        piece = [rng.randrange(5, 500) for _ in range(span)]
        if copying:  # the copying model's cycle, from a random place
            start = rng.randrange(len(CYCLE))
            piece = [CYCLE[(start + j) % len(CYCLE)] for j in range(span)]
        rep.append(piece * repeats)
    plain = [[rng.randrange(5, 500) for _ in range(span * repeats)] for _ in range(n)]
    return {"repetitive": rep, "non-repetitive": plain}


def run(model: Path, algorithm: str | None, prompts, batch: int, max_new: int, device: str, steps: int,
        graphs: bool = False, wall: bool = False):
    extra = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": steps + 1} if algorithm else {}
    if algorithm == "STANDALONE":
        extra["speculative_draft_model_path"] = str(model.parent / f"{model.name}-draft")
    if algorithm in ("EAGLE", "EAGLE3"):
        extra["speculative_draft_model_path"] = str(model.parent / f"{model.name}-{algorithm.lower()}")
    args = ServerArgs(model_path=str(model), device=device, max_total_tokens=8192, cuda_graph_max_bs=8,
                      disable_cuda_graph=not graphs, disable_overlap_schedule=True, disable_radix_cache=True, **extra)
    scheduler = Scheduler(args, 0, TpModelWorker(args, 0))
    scheduler.sender.socket = _Capture()
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    runner = scheduler.worker.model_runner
    clock = time.perf_counter if wall else time.process_time
    sync = torch.cuda.synchronize if wall and device.startswith("cuda") else (lambda: None)
    start_steps, elapsed = runner.forward_pass_id, 0.0
    for first in range(0, len(prompts), batch):
        for i, ids in enumerate(prompts[first : first + batch]):
            scheduler.intake.handle(TokenizedGenerateReqInput(rid=f"r{first + i}", input_ids=ids, sampling_params=params))
        sync()
        t0 = clock()
        while True:
            batch_ = scheduler.get_next_batch_to_run()
            if batch_ is None:
                break
            scheduler.results.process(batch_, scheduler.run_batch(batch_))
        sync()
        elapsed += clock() - t0
    outputs: dict[str, list[int]] = {}
    for msg in scheduler.sender.socket.messages:
        if isinstance(msg, BatchTokenOut):
            for out in msg.outs:
                outputs.setdefault(out.rid, []).extend(out.ids)
    target_steps = runner.forward_pass_id - start_steps
    tokens = sum(len(v) for v in outputs.values())
    stats = scheduler.speculative.stats if scheduler.speculative is not None else None
    return {
        "outputs": outputs,
        "accept_len": stats.mean_accepted_length if stats else 1.0,
        "accept_rate": stats.acceptance_rate if stats else float("nan"),
        "steps_per_token": target_steps / tokens,
        "ms_per_step": 1000 * elapsed / target_steps,
        "ms_per_token": 1000 * elapsed / tokens,
        "graphs": scheduler.worker.captured_graphs(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads (times are process CPU time)")
    p.add_argument("--span", type=int, default=16)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--num-steps", type=int, default=4, help="--speculative-num-steps (drafts per verify)")
    p.add_argument("--draft-layers", type=int, default=1, help="STANDALONE: the draft's decoder layers")
    p.add_argument("--device", default="cpu")
    p.add_argument("--graphs", action="store_true",
                   help="CUDA graphs on (decode, verify and the draft's decode graphs up to batch 8; GPU only)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="process CPU time (default; other load does not count) or wall time (GPU)")
    p.add_argument("--models", default="random,copying", help="comma-separated subset of random,copying")
    p.add_argument("--prompt-sets", default="repetitive,non-repetitive",
                   help="comma-separated subset of repetitive,non-repetitive")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--proposers", default=",".join(str(x) for x in PROPOSERS),
                   help="comma-separated subset of None,NGRAM,STANDALONE,EAGLE,EAGLE3 (None: the baseline, always run)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_checkpoint(Path(tmp) / "m", arch="llama", seed=0, hidden_size=a.hidden,
                                     intermediate_size=4 * a.hidden, num_hidden_layers=a.layers,
                                     max_position_embeddings=4096)
        copying = make_cycle_checkpoint(model, Path(tmp) / "copying", CYCLE, 8.0)
        for target in (model, copying):
            make_draft_checkpoint(target, target.parent / f"{target.name}-draft", num_layers=a.draft_layers)
        make_eagle_checkpoint(model, Path(tmp) / "m-eagle")
        make_cycle_eagle_checkpoint(copying, Path(tmp) / "copying-eagle", CYCLE)
        make_eagle3_checkpoint(model, Path(tmp) / "m-eagle3")
        make_cycle_eagle3_checkpoint(copying, Path(tmp) / "copying-eagle3", CYCLE)
        print("| model | prompts | batch | proposer | accept len | accept rate | target steps / token | ms / step "
              "| ms / token | tokens / s | vs none |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for label, path in (("random", model), ("copying", copying)):
            if label not in a.models.split(","):
                continue
            for name, prompts in prompt_sets(a.prompts, a.span, a.repeats, label == "copying").items():
                if name not in a.prompt_sets.split(","):
                    continue
                for batch in a.batches:
                    table_rows(label, name, path, prompts, batch, a)


def table_rows(label: str, name: str, path: Path, prompts, batch: int, a) -> None:
    """One table row per proposer; raises SystemExit when speculation changed the output."""
    base, base_ms = None, 1.0
    chosen = set(a.proposers.split(","))
    for algorithm in PROPOSERS:
        if algorithm is not None and algorithm not in chosen:
            continue
        r = run(path, algorithm, prompts, batch, a.max_new_tokens, a.device, a.num_steps, a.graphs,
                a.clock == "wall")
        if base is None:
            base, base_ms = r["outputs"], r["ms_per_token"]
        elif r["outputs"] != base:
            raise SystemExit(f"{algorithm} changed the greedy output on {label}/{name} batch {batch}")
        print(f"| {label} | {name} | {batch} | {algorithm or 'none'} | {r['accept_len']:.2f} | "
              f"{r['accept_rate']:.2f} | {r['steps_per_token']:.3f} | {r['ms_per_step']:.1f} | "
              f"{r['ms_per_token']:.1f} | {1000 / r['ms_per_token']:.0f} | {base_ms / r['ms_per_token']:.2f}x |",
              flush=True)
        if a.graphs:  # what really ran through graphs (a reason when something was not captured)
            print(f"  graphs: {r['graphs'].model_dump_json()}", flush=True)
            missing = r["graphs"].reason or r["graphs"].speculative_reason
            if a.device.startswith("cuda") and missing:
                raise SystemExit(f"--graphs on {a.device}: not captured: {missing}")


if __name__ == "__main__":
    main()
