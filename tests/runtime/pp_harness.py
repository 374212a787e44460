"""Pipeline parallelism on CPU: world ranks (tp x pp gloo processes) each run a real
TpModelWorker + Scheduler over the same messages, driven by the scheduler's own ``PipelineLoop.step``.

Stage 0 gets each scenario's messages through its ``receiver`` (instead of ZMQ); the other
stages receive them from the stage before, as in serving. Every rank records the tokens it
appended per request, so a test sees that the last stage's ids reached every rank.
"""

from __future__ import annotations

import os
import time
from typing import Any

import harness
import torch

from shardline_runtime.managers.io_struct import BatchTokenOut, TokenizedGenerateReqInput
from shardline_runtime.sampling.sampling_params import SamplingParams


class Capture:
    """What world rank 0 would send to the HTTP process."""

    def __init__(self):
        self.messages: list[Any] = []

    def send_pyobj(self, msg):
        self.messages.append(msg)


def greedy(rid: str, ids: list[int], n: int, **kw) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid=rid, input_ids=list(ids),
                                     sampling_params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
                                     **kw)


def make_scheduler(path, world_rank: int = 0, tp_size: int = 1, pp_size: int = 1, port: int | None = None,
                   loop_size: int | None = None, **overrides):
    """Worker + scheduler of one world rank (CPU, float32); world rank 0 captures its outputs."""
    from shardline_runtime.distributed.parallel_state import rank_layout
    from shardline_runtime.managers.scheduler import Scheduler
    from shardline_runtime.managers.tp_worker import TpModelWorker
    from shardline_runtime.server_args import ServerArgs

    values = dict(model_path=str(path), max_total_tokens=2048, device="cpu", dtype="float32", disable_cuda_graph=True,
                  tp_size=tp_size, pp_size=pp_size, dist_timeout=120,
                  dist_init_addr=f"127.0.0.1:{port}" if port else None)
    values.update(overrides)
    args = ServerArgs(**values)
    pp_rank, tp_rank = rank_layout(world_rank, tp_size)
    scheduler = Scheduler(args, tp_rank, TpModelWorker(args, tp_rank, pp_rank=pp_rank), pp_loop_size=loop_size)
    if world_rank == 0:
        scheduler.sender.socket = Capture()
    return scheduler


def drive(scheduler, feeds: list, max_iters: int = 3000) -> dict[str, list[int]]:
    """Give each message list to the scheduler in turn (one loop iteration) and run until nothing
    runs, queues or is in flight; a feed ``(n, messages)`` runs exactly ``n`` iterations instead.
    The same stop rule holds on every rank at the same iteration. Returns the output ids every
    request ended with on this rank."""
    worker, reqs = scheduler.worker, {}
    pending: list[list[Any]] = []
    if worker.pp_rank == 0:
        scheduler.receiver.recv = lambda idle=False: pending.pop(0) if pending else []
    admit = scheduler.intake.admit

    def record(req):
        reqs[req.rid] = req
        admit(req)

    scheduler.intake.admit = record
    pipeline = scheduler.pipeline
    for feed in feeds:
        iterations, feed = feed if isinstance(feed, tuple) else (None, feed)
        if worker.pp_rank == 0:
            pending.append(list(feed))  # taken by the next iteration; later stages get it from stage 0
        for done in range(max_iters):
            if pipeline is not None:
                pipeline.step()
                scheduler.max_busy_slots = max(getattr(scheduler, "max_busy_slots", 0), pipeline.busy_slots())
            else:
                scheduler.process_input_requests(scheduler.recv_requests())
                batch = scheduler.get_next_batch_to_run()
                if batch is not None:
                    scheduler.results.process(batch, scheduler.run_batch(batch))
            if iterations is not None:
                if done + 1 == iterations:
                    break
            elif not scheduler.planner.running_batches() and not scheduler.prefill_manager.waiting_queue \
                    and scheduler.prefill_manager.chunked_req is None and scheduler.control.pending_update is None:
                break
        else:
            raise AssertionError("the scheduler did not finish")
    return {rid: list(req.output_ids) for rid, req in reqs.items()}


def captured(scheduler) -> dict[str, dict]:
    """Per rid from rank 0's outputs: ids, finish reason, cached tokens; plus other replies."""
    out: dict[str, dict] = {}
    for msg in scheduler.sender.socket.messages:
        if isinstance(msg, BatchTokenOut):
            for t in msg.outs:
                r = out.setdefault(t.rid, {"ids": [], "finish": None, "cached": 0})
                r["ids"] += t.ids
                r["finish"] = t.finish.to_dict() if t.finish is not None else r["finish"]
                r["cached"] = t.usage.cached_tokens
        elif hasattr(msg, "success"):
            out.setdefault("_replies", []).append((msg.success, msg.message, getattr(msg, "data", None)))
    return out


def forced_logits(worker, prompts: list[list[int]], forced: list[list[int]], split: int = 3) -> list | None:
    """Teacher-forced steps through this stage (every stage knows the tokens): each prompt in
    two extends (the second after a cached prefix of ``split``), then decodes of ``forced``.
    Returns the last stage's logits per step; None on other stages."""
    runner = worker.model_runner

    class StageRunner:  # the harness's runner interface, forwarding through the stage
        def __getattr__(self, name):
            return getattr(runner, name)

        def forward(self, forward_batch):
            output = runner.forward(forward_batch, worker.recv_proxy_tensors())
            if not worker.is_last_stage:
                worker.send_proxy_tensors(output)
            return output

    stage = StageRunner()
    seqs = harness.new_seqs(runner, len(prompts))
    harness.extend(stage, seqs, [p[:split] for p in prompts])
    outs = [harness.extend(stage, seqs, [p[split:] for p in prompts])]
    for step in range(len(forced[0])):
        outs.append(harness.decode(stage, seqs, [f[step] for f in forced]))
    harness.release(runner, seqs)
    if not worker.is_last_stage:
        return None
    return [o.next_token_logits.clone() for o in outs]


def rank_main(world_rank: int, tp_size: int, pp_size: int, port: int, scenarios: list[dict], out_dir: str) -> None:
    """One world rank: run every scenario and save ``{name: result}`` to ``rank<r>.pt``."""
    torch.set_num_threads(1)
    results = {}
    for sc in scenarios:
        if sc.get("fail_update_stage") == world_rank // tp_size:  # this stage alone rejects updates
            from shardline_runtime.model_executor import weight_staging

            def reject(*_args, **_kwargs):
                raise weight_staging.WeightUpdateError("rejected on this stage by the test")

            weight_staging.prepare_candidate = reject
        scheduler = make_scheduler(sc["path"], world_rank, tp_size, pp_size, port, sc.get("loop_size"),
                                   **sc.get("overrides", {}))
        worker = scheduler.worker
        replayed: list[int] = []
        if sc.get("static_graphs"):  # each stage's decode graphs on the CPU static-buffer path
            from shardline_runtime.model_executor.cuda_graph_runner import CudaGraphRunner
            from shardline_runtime.model_executor.device_graphs import DeviceGraphs

            runner = worker.model_runner
            decode = CudaGraphRunner(runner, capture=False, batch_sizes=[1, 2, 4])
            original = decode.replay
            decode.replay = lambda fb, proxy=None: replayed.append(fb.batch_size) or original(fb, proxy)
            runner.graphs = DeviceGraphs(runner, decode=decode)
        res: dict[str, Any] = {"stage": worker.model_runner.pipeline_stage,
                               "kv_layers": worker.model_runner.token_to_kv_pool.num_layers,
                               "params": sorted(n for n, _ in worker.model_runner.model.named_parameters())}
        if sc.get("forced"):
            res["logits"] = forced_logits(worker, sc["prompts"], sc["forced"])
        res["tokens"] = drive(scheduler, sc["feeds"])
        res["replayed"] = replayed
        res["retractions"] = sum(dm.num_retractions for dm in scheduler.decode_managers)
        res["max_busy_slots"] = getattr(scheduler, "max_busy_slots", 0)  # slots decoding at once
        res["kv_leaked"] = scheduler.cache.used_tokens()  # KV held by no request once all finished
        if world_rank == 0:
            res["outputs"] = captured(scheduler)
        model = worker.model_runner.model
        if worker.is_last_stage and hasattr(model.lm_head, "weight"):
            res["lm_head"] = model.lm_head.weight.detach().clone()
        results[sc["name"]] = res
        worker.pending_sends.wait_all()
    torch.save(results, os.path.join(out_dir, f"rank{world_rank}.pt"))
    from shardline_runtime.distributed import destroy_distributed_environment

    destroy_distributed_environment()


def run_pp(tp_size: int, pp_size: int, scenarios: list[dict], out_dir, timeout_s: float = 600) -> list[dict]:
    """Run ``rank_main`` in ``tp_size * pp_size`` spawned processes; each world rank's results."""
    import torch.multiprocessing as mp

    world = tp_size * pp_size
    port = harness.free_port()
    ctx = mp.spawn(rank_main, args=(tp_size, pp_size, port, scenarios, str(out_dir)), nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"tp={tp_size} x pp={pp_size} ranks did not finish within {timeout_s}s")
    return [torch.load(f"{out_dir}/rank{r}.pt", weights_only=False) for r in range(world)]
