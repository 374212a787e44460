"""Drive a Scheduler in-process on a real TpModelWorker (TP 1, CPU), capturing rank 0's outputs."""

from __future__ import annotations

from shardline_runtime.managers.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput
from shardline_runtime.managers.scheduler import Scheduler
from shardline_runtime.managers.tp_worker import TpModelWorker
from shardline_runtime.sampling.sampling_params import SamplingParams
from shardline_runtime.server_args import ServerArgs


class _Capture:
    """Collects what rank 0 would send to the HTTP process."""

    def __init__(self):
        self.messages = []

    def send_pyobj(self, msg):
        self.messages.append(msg)


def make_scheduler(model_path, **overrides) -> Scheduler:
    values = dict(model_path=str(model_path), max_total_tokens=2048, device="cpu", disable_cuda_graph=True)
    values.update(overrides)
    args = ServerArgs(**values)
    scheduler = Scheduler(args, 0, TpModelWorker(args, 0))
    scheduler.send_socket = _Capture()
    return scheduler


def run_to_completion(scheduler: Scheduler, max_steps: int = 20000) -> dict[str, dict]:
    """Step the scheduler until idle; return per rid: tokens, finish reason, messages."""
    results: dict[str, dict] = {}
    for _ in range(max_steps):
        scheduler.process_input_requests([])  # as the event loop: runs a pending weight update
        batch = scheduler.get_next_batch_to_run()
        if batch is None and scheduler.is_idle():
            break
        if batch is not None:
            scheduler.process_batch_result(batch, scheduler.run_batch(batch))
    else:
        raise AssertionError("scheduler did not finish")
    for msg in scheduler.send_socket.messages:
        if not isinstance(msg, BatchTokenIDOut):
            continue
        for i, rid in enumerate(msg.rids):
            r = results.setdefault(rid, {"ids": [], "finish": None, "chunks": 0, "prompt_logprobs": None, "cached": 0})
            r["ids"] += msg.output_ids[i]
            r["chunks"] += 1
            r["finish"] = msg.finished_reasons[i] or r["finish"]
            r["cached"] = msg.cached_tokens[i]
            if msg.input_token_logprobs[i] is not None:
                r["prompt_logprobs"] = msg.input_token_logprobs[i]
    return results


def greedy(rid, ids, n, **kw) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid, list(ids), SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True), **kw)
