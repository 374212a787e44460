"""Test harness: run prompts through a ModelRunner without a scheduler.

Allocates request rows and KV slots from the runner's pools, fills ``req_to_token`` and
builds the ForwardBatch of an EXTEND (optionally after a cached prefix) or a DECODE step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from shardline_runtime.model_executor.forward_batch_info import ForwardBatch, ForwardMode


@dataclass
class Seq:
    """One request's state in the harness: its row, tokens so far and their KV slots."""

    row: int
    tokens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


def new_seqs(runner, n: int) -> list[Seq]:
    rows = runner.req_to_token_pool.alloc(n)
    assert rows is not None, "out of request rows"
    return [Seq(row=r) for r in rows]


def _alloc(runner, n: int) -> list[int]:
    slots = runner.token_to_kv_pool_allocator.alloc(n)
    assert slots is not None, "out of KV slots"
    return slots.tolist()


def extend(runner, seqs: list[Seq], new_tokens: list[list[int]], return_logprob: bool = False,
           logprob_starts: list[int] | None = None, top_logprobs_nums: list[int] | None = None):
    """Run an EXTEND step adding ``new_tokens[i]`` after each seq's existing tokens (its cached
    prefix). Returns the LogitsProcessorOutput."""
    input_ids, out_loc, prefix_lens, seq_lens = [], [], [], []
    for seq, toks in zip(seqs, new_tokens):
        slots = _alloc(runner, len(toks))
        prefix_lens.append(len(seq.tokens))
        seq.tokens += list(toks)
        seq.slots += slots
        runner.req_to_token_pool.write((seq.row, slice(0, len(seq.slots))), torch.tensor(seq.slots))
        input_ids += list(toks)
        out_loc += slots
        seq_lens.append(len(seq.tokens))
    fb = ForwardBatch.init_new(
        forward_mode=ForwardMode.EXTEND, input_ids=input_ids, req_pool_indices=[s.row for s in seqs],
        seq_lens=seq_lens, extend_prefix_lens=prefix_lens, out_cache_loc=out_loc, model_runner=runner,
        return_logprob=return_logprob, extend_logprob_start_lens=logprob_starts, top_logprobs_nums=top_logprobs_nums,
    )
    return runner.forward(fb)


def decode(runner, seqs: list[Seq], tokens: list[int]):
    """Run one DECODE step feeding ``tokens[i]`` to seq ``i``. Returns the LogitsProcessorOutput."""
    slots = _alloc(runner, len(seqs))
    for seq, tok, slot in zip(seqs, tokens, slots):
        seq.tokens.append(tok)
        seq.slots.append(slot)
        runner.req_to_token_pool.write((seq.row, len(seq.slots) - 1), torch.tensor(slot))
    fb = ForwardBatch.init_new(
        forward_mode=ForwardMode.DECODE, input_ids=tokens, req_pool_indices=[s.row for s in seqs],
        seq_lens=[len(s.tokens) for s in seqs], out_cache_loc=slots, model_runner=runner,
    )
    return runner.forward(fb)


def release(runner, seqs: list[Seq]) -> None:
    """Free the seqs' KV slots and rows."""
    for seq in seqs:
        if seq.slots:
            runner.token_to_kv_pool_allocator.free(torch.tensor(seq.slots))
        runner.req_to_token_pool.free(seq.row)
        seq.slots, seq.tokens = [], []


def greedy_generate(runner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy tokens for each prompt (batched extend, then ``steps - 1`` batched decodes)."""
    seqs = new_seqs(runner, len(prompts))
    out = extend(runner, seqs, prompts)
    nxt = out.next_token_logits.argmax(-1).tolist()
    generated = [[t] for t in nxt]
    for _ in range(steps - 1):
        out = decode(runner, seqs, nxt)
        nxt = out.next_token_logits.argmax(-1).tolist()
        for g, t in zip(generated, nxt):
            g.append(t)
    release(runner, seqs)
    return generated


def make_runner(path, tp_rank: int = 0, tp_size: int = 1, dist_init_addr: str | None = None, **kwargs):
    """A CPU float32 ModelRunner with a small KV pool; ``kwargs`` are ``ServerArgs`` fields, plus
    ``pp_rank`` and ``cpu_kv_cache_bytes`` (the runner's own)."""
    from shardline_runtime.model_executor.model_runner import ModelRunner
    from shardline_runtime.server_args import ServerArgs

    pp_rank = kwargs.pop("pp_rank", 0)
    extra = {"cpu_kv_cache_bytes": kwargs.pop("cpu_kv_cache_bytes")} if "cpu_kv_cache_bytes" in kwargs else {}
    cfg = dict(model_path=str(path), device="cpu", dtype="float32", max_total_tokens=2048, max_running_requests=8,
               tp_size=tp_size, dist_init_addr=dist_init_addr, dist_timeout=60)
    cfg.update(kwargs)
    return ModelRunner(ServerArgs(**cfg), tp_rank, pp_rank, **extra)


# ---- tensor parallel: several gloo processes on CPU ---------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_scenario(runner, prompts: list[list[int]], steps: int, split: int = 3) -> dict:
    """Extend each prompt in two parts (the second after a cached prefix of ``split`` tokens),
    then ``steps`` greedy decodes; returns the logits of every step and the greedy tokens."""
    seqs = new_seqs(runner, len(prompts))
    extend(runner, seqs, [p[:split] for p in prompts])
    out = extend(runner, seqs, [p[split:] for p in prompts])
    logits = [out.next_token_logits.clone()]
    nxt = out.next_token_logits.argmax(-1).tolist()
    tokens = [nxt]
    for _ in range(steps):
        out = decode(runner, seqs, nxt)
        logits.append(out.next_token_logits.clone())
        nxt = out.next_token_logits.argmax(-1).tolist()
        tokens.append(nxt)
    release(runner, seqs)
    return {"logits": logits, "tokens": tokens}


def tp_worker(rank: int, tp_size: int, port: int, scenarios: list[dict], out_dir: str) -> None:
    """Body of one TP rank: run each scenario (``path``, ``prompts``, ``steps``, optional
    ``runner_kwargs`` for ``make_runner``) and save
    ``{name: result}`` plus per-rank shard facts to ``out_dir/rank<rank>.pt``."""
    import os

    torch.set_num_threads(1)
    results = {}
    for sc in scenarios:
        runner = make_runner(sc["path"], tp_rank=rank, tp_size=tp_size, dist_init_addr=f"127.0.0.1:{port}",
                             **sc.get("runner_kwargs", {}))
        res = run_scenario(runner, sc["prompts"], sc["steps"])
        model = runner.model
        res["lm_head_shard"] = model.lm_head.weight.detach().clone()
        res["embed_shard"] = model.model.embed_tokens.weight.detach().clone()
        res["vocab_range"] = (model.model.embed_tokens.vocab_start_index, model.model.embed_tokens.vocab_end_index)
        res["kv_heads_per_rank"] = runner.token_to_kv_pool.num_kv_heads
        results[sc["name"]] = res
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    from shardline_runtime.distributed import destroy_distributed_environment

    destroy_distributed_environment()


def run_tp(tp_size: int, scenarios: list[dict], out_dir, timeout_s: float = 300) -> list[dict]:
    """Run ``tp_worker`` in ``tp_size`` spawned processes; returns each rank's results."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.spawn(tp_worker, args=(tp_size, port, scenarios, str(out_dir)), nprocs=tp_size, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"TP={tp_size} workers did not finish within {timeout_s}s")
    return [torch.load(f"{out_dir}/rank{r}.pt") for r in range(tp_size)]


def collectives_worker(rank: int, port: int, out_dir: str, die_rank: int | None = None, timeout_s: float = 10,
                       hang: bool = False) -> None:
    """Join a 2-rank gloo group; exercise the collectives, or with ``die_rank`` have that rank
    exit (or, with ``hang``, stop taking part) and the other time how long a collective takes
    to fail. Saves a dict per rank."""
    import os

    from shardline_runtime import distributed as D

    D.init_distributed_environment(rank, 2, torch.device("cpu"), f"127.0.0.1:{port}", timeout_s=timeout_s)
    res = {}
    if die_rank is None:
        x = torch.full((3,), float(rank + 1))
        res["all_reduce"] = D.tensor_model_parallel_all_reduce(x).tolist()
        res["all_gather"] = D.tensor_model_parallel_all_gather(torch.tensor([[rank, rank]]), dim=-1).tolist()
        res["pyobj"] = D.broadcast_pyobj({"reqs": ["a", rank]} if rank == 0 else None)
        res["min"] = D.all_reduce_min_int(10 + rank)
        D.destroy_distributed_environment()
    elif rank == die_rank:
        if hang:
            time.sleep(timeout_s * 6)
        os._exit(0)
    else:
        start = time.monotonic()
        try:
            for _ in range(100):
                D.tensor_model_parallel_all_reduce(torch.ones(4))
                time.sleep(0.05)
            res["error"] = None
        except Exception as e:  # the point: it must end in an error
            res["error"] = f"{type(e).__name__}: {e}"
        res["elapsed_s"] = time.monotonic() - start
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
