"""Cost of constrained decoding on a CPU decode step, and grammar compile time per new schema.

A real ``Scheduler`` over a ``TpModelWorker`` (one process, no overlap, so each step is timed
alone) decodes a batch of ``--batch`` requests of which 0 %, 50 % or 100 % are constrained by a
JSON schema (an object holding an array of at least 100 digits, so no constrained request can
finish inside the measured steps; free requests run with ``ignore_eos``). A decode step's time
covers what constrained decoding adds: filling the token bitmask rows on the host
(``ScheduleBatch.get_model_worker_batch``), applying it to the logits before sampling, and
advancing each matcher with its token (``ResultProcessor``). Fractions are interleaved per
repeat; the median step of each is reported with the ratio to 0 %. Steps are timed in this
process's CPU time (``time.process_time``, all threads), which a busy shared machine disturbs far
less than wall time. The constrained work alone (fill 16 rows, apply, advance 16 matchers) is
also timed in isolation and reported as a fraction of the free step.

Compile time: ``--schemas`` distinct schemas (new property names each) compiled by a fresh
``GrammarBackend`` on the checkpoint's tokenizer (first compile, then the cached one).

Usage::

    python bench/structured.py --threads 2 --vocab-size 32768 --hidden-size 256 --layers 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from shardline_runtime.constrained.grammar_spec import GrammarSpec
from shardline_runtime.constrained.xgrammar_backend import (
    GrammarBackend,
    allow_all_bitmask,
    apply_token_bitmask,
)
from shardline_runtime.managers.io_struct import TokenizedGenerateReqInput
from shardline_runtime.managers.scheduler import Scheduler
from shardline_runtime.managers.tp_worker import TpModelWorker
from shardline_runtime.sampling.sampling_params import SamplingParams
from shardline_runtime.server_args import ServerArgs
from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "minItems": 100}
    },
    "required": ["values"],
    "additionalProperties": False,
}


class _Sink:
    def send_pyobj(self, msg):
        pass


def decode_step_times(scheduler: Scheduler, constrained: int, batch: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` decode steps of a batch of ``batch`` requests, ``constrained``
    of them under the schema (all prefilled first, outside the timing)."""
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    for i in range(batch):
        params = SamplingParams(max_new_tokens=steps + 8, temperature=1.0, seed=i, ignore_eos=True)
        scheduler.intake.handle(TokenizedGenerateReqInput(
            rid=f"r{constrained}-{i}-{time.monotonic_ns()}", input_ids=[5 + (i * 7 + j) % 400 for j in range(16)],
            sampling_params=params, grammar=spec if i < constrained else None))
    times = []
    while True:
        step = scheduler.get_next_batch_to_run()
        if step is None:
            break
        start = time.process_time()
        scheduler.results.process(step, scheduler.run_batch(step))
        if step.forward_mode.is_decode() and len(step.reqs) == batch:
            times.append(time.process_time() - start)
    return times[:steps]


def constrained_work(path: Path, vocab_size: int, batch: int, steps: int) -> float:
    """CPU seconds per step of the constrained work alone for ``batch`` rows: fill the bitmask,
    apply it to (batch, vocab) logits, advance every matcher with an allowed token."""
    backend = GrammarBackend.from_tokenizer_path(str(path), vocab_size, [2])
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    grammars = [backend.matcher(spec) for _ in range(batch)]
    logits = torch.randn(batch, vocab_size)
    start = time.process_time()
    for _ in range(steps):
        bitmask = allow_all_bitmask(batch, vocab_size)
        for i, grammar in enumerate(grammars):
            grammar.fill_bitmask(bitmask, i)
        masked = apply_token_bitmask(logits.clone(), bitmask)
        for grammar, token in zip(grammars, masked.argmax(dim=-1).tolist()):
            grammar.accept(token)
    return (time.process_time() - start) / steps


def compile_times(path: Path, vocab_size: int, count: int) -> tuple[list[float], float]:
    backend = GrammarBackend.from_tokenizer_path(str(path), vocab_size, [2])
    first = []
    for k in range(count):
        schema = {"type": "object", "properties": {f"field_{k}_{j}": {"type": "integer"} for j in range(5)},
                  "required": [f"field_{k}_0"]}
        spec = GrammarSpec("json_schema", json.dumps(schema))
        start = time.process_time()
        backend.compile(spec)
        first.append(time.process_time() - start)
    start = time.process_time()
    backend.compile(spec)
    return first, time.process_time() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--schemas", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "ckpt", "llama", vocab_size=args.vocab_size,
                                    hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
                                    num_hidden_layers=args.layers, max_position_embeddings=2048)
        server_args = ServerArgs(model_path=str(path), max_total_tokens=8192, device="cpu",
                                 disable_cuda_graph=True, disable_overlap_schedule=True,
                                 disable_radix_cache=True)
        scheduler = Scheduler(server_args, 0, TpModelWorker(server_args, 0))
        scheduler.sender.socket = _Sink()
        fractions = {"0%": 0, "50%": args.batch // 2, "100%": args.batch}
        decode_step_times(scheduler, args.batch, args.batch, 4)  # warm up (and build the backend)
        samples: dict[str, list[float]] = {name: [] for name in fractions}
        for _ in range(args.repeats):
            for name, constrained in fractions.items():
                samples[name] += decode_step_times(scheduler, constrained, args.batch, args.steps)
        base = statistics.median(samples["0%"])
        print(f"decode step, batch {args.batch}, vocab {args.vocab_size}, hidden {args.hidden_size}, "
              f"{args.layers} layers, {args.threads} threads ({args.repeats} x {args.steps} steps each):")
        for name in fractions:
            med = statistics.median(samples[name])
            print(f"  {name:>4} constrained: median {med * 1e3:7.2f} ms  ({med / base:.3f}x)")
        work = constrained_work(path, args.vocab_size, args.batch, args.steps)
        print(f"  constrained work alone, {args.batch} rows: {work * 1e3:.2f} ms per step "
              f"({work / base:.3f} of the free step)")
        first, cached = compile_times(path, args.vocab_size, args.schemas)
        print(f"grammar compile per new schema ({args.schemas} schemas): median "
              f"{statistics.median(first) * 1e3:.1f} ms, max {max(first) * 1e3:.1f} ms; cached {cached * 1e6:.0f} us")


if __name__ == "__main__":
    main()
