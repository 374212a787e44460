"""Test support: drive a TpModelWorker like a minimal scheduler, and transformers references.

``run_engine`` admits one new request per step, so steps mix EXTEND (the newcomer) and DECODE
(the running requests) in one forward via ``ScheduleBatch.mix_with_running``; optional chunked
prefill keeps a long prompt's intermediate chunks from sampling.
"""

from __future__ import annotations

import torch

from shardline_runtime.managers.schedule_batch import Req, ScheduleBatch
from shardline_runtime.managers.tp_worker import TpModelWorker
from shardline_runtime.sampling import SamplingParams
from shardline_runtime.server_args import ServerArgs


def make_worker(
    model_path, max_total_tokens: int = 4096, max_running_requests: int = 16, device_override: str = "cpu",
    tp_rank: int = 0, **kwargs
) -> TpModelWorker:
    """A worker of TP rank ``tp_rank`` on ``device_override`` (``cpu`` by default); ``kwargs`` go
    to ``ServerArgs`` (e.g. ``tp_size``, ``dist_init_addr``)."""
    args = ServerArgs(
        model_path=str(model_path), device=device_override, max_total_tokens=max_total_tokens,
        max_running_requests=max_running_requests, **kwargs,
    )
    return TpModelWorker(args, tp_rank)


def run_engine(worker, prompts, params, mixed: bool = True, chunk: int | None = None, eos_token_ids=()):
    """Generate for every prompt together; returns each request's output ids (in order).

    Args:
        prompts: lists of token ids.  params: one ``SamplingParams`` per prompt (or one for all).
        mixed: new requests join the running decode batch in one EXTEND step.
        chunk: chunked-prefill size (None: whole prompts).
    """
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    reqs = [Req(f"r{i}", p, sp, eos_token_ids=eos_token_ids) for i, (p, sp) in enumerate(zip(prompts, params))]
    waiting, running = list(reqs), None
    base_free = worker.token_to_kv_pool_allocator.available_size()
    while waiting or running is not None:
        if waiting:
            req = waiting.pop(0)
            req.init_next_round_input(max_extend_len=chunk)
            batch = ScheduleBatch.init_new([req], worker)
            batch.prepare_for_extend()
            if running is not None and mixed:
                batch.mix_with_running(running)
                running = None
        else:
            batch = running
            batch.prepare_for_decode()
        result = worker.forward_batch_generation(batch.get_model_worker_batch()).copy_to_cpu().wait()
        keep = []
        for i, r in enumerate(batch.reqs):
            token = int(result.next_token_ids[i])
            if token >= 0:
                r.append_output(token, result.next_token_logprobs[i], result.next_token_top_logprobs[i])
            elif r.is_chunked:
                waiting.insert(0, r)  # its next chunk runs next step
                continue
            r.check_finished(worker.max_req_len)
            if r.finished():
                batch.release_kv(r)
            else:
                keep.append(i)
        batch.filter_batch(keep)
        if batch is running:
            pass
        elif running is None:
            running = batch
        else:
            running.merge_batch(batch)
        if running is not None and running.is_empty():
            running = None
    assert worker.token_to_kv_pool_allocator.available_size() == base_free, "KV slots leaked"
    return [r.output_ids for r in reqs]


def hf_greedy(model_path, prompts, max_new_tokens: int):
    """transformers ``generate`` (greedy, no EOS stop) for each prompt, in float32."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
            outs.append(gen[0, len(p):].tolist())
    return outs


def tp_rank_main(rank: int, tp_size: int, port: int, path_a: str, path_b: str, prompts, out_dir: str) -> None:
    """One TP rank (spawned): sampled generation, a weight update that fails on rank 1 only,
    then a real update A -> B; saves what it saw to ``out_dir/rank<rank>.pt``."""
    import os

    from shardline_runtime.distributed import destroy_distributed_environment
    from shardline_runtime.model_executor import weight_staging

    torch.set_num_threads(1)
    worker = make_worker(path_a, tp_rank=rank, tp_size=tp_size, dist_init_addr=f"127.0.0.1:{port}", random_seed=7 + rank)
    res = {"seed": worker.random_seed}
    sampled = [SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True),
               SamplingParams(temperature=0.9, top_k=20, max_new_tokens=8, seed=11, ignore_eos=True)]
    res["sampled"] = run_engine(worker, prompts[:2], sampled)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    res["greedy_a"] = run_engine(worker, prompts, greedy)
    real_load = weight_staging.prepare_candidate
    if rank == 1:
        def failing(*args, **kwargs):
            raise OSError("disk error injected on rank 1")
        weight_staging.prepare_candidate = failing
    phases: list = []
    res["failed_update"] = worker.update_weights_from_disk(path_b, on_phase=phases.append)
    weight_staging.prepare_candidate = real_load
    res["phase_after_failure"] = phases[-1].value
    res["greedy_after_failure"] = run_engine(worker, prompts, greedy)
    res["update"] = worker.update_weights_from_disk(path_b)
    res["greedy_b"] = run_engine(worker, prompts, greedy)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    destroy_distributed_environment()
