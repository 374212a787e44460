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
    scheduler.sender.socket = _Capture()
    return scheduler


def run_to_completion(scheduler: Scheduler, max_steps: int = 20000) -> dict[str, dict]:
    """Step the scheduler until idle (one step at a time, no overlap); return per rid: tokens,
    finish reason, messages (:func:`collect_results`)."""
    for _ in range(max_steps):
        scheduler.process_input_requests([])  # as the event loop: runs a pending weight update
        batch = scheduler.get_next_batch_to_run()
        if batch is None and scheduler.is_idle():
            break
        if batch is not None:
            scheduler.results.process(batch, scheduler.run_batch(batch))
    else:
        raise AssertionError("scheduler did not finish")
    return collect_results(scheduler.sender.socket.messages)


def run_loop(scheduler: Scheduler, arrivals: dict[int, list], max_steps: int = 20000) -> dict[str, dict]:
    """Drive the scheduler's own loop (``run_step``, overlap or not) with ``arrivals[i]``
    delivered at iteration ``i``, until every message is delivered and it is idle."""
    last = max(arrivals, default=0)
    for step in range(max_steps):
        scheduler.run_step(arrivals.get(step, []))
        if step >= last and scheduler.is_idle():
            break
    else:
        raise AssertionError("scheduler did not finish")
    return collect_results(scheduler.sender.socket.messages)


def collect_results(messages) -> dict[str, dict]:
    """Per rid: tokens, finish reason, output messages, prompt logprobs, cached tokens and the
    sampled tokens' logprobs, from what rank 0 sent."""
    results: dict[str, dict] = {}
    for msg in messages:
        if not isinstance(msg, BatchTokenIDOut):
            continue
        for i, rid in enumerate(msg.rids):
            r = results.setdefault(rid, {"ids": [], "finish": None, "chunks": 0, "prompt_logprobs": None, "cached": 0,
                                         "logprobs": []})
            r["ids"] += msg.output_ids[i]
            r["chunks"] += 1
            r["finish"] = msg.finished_reasons[i] or r["finish"]
            r["cached"] = msg.cached_tokens[i]
            if msg.input_token_logprobs[i] is not None:
                r["prompt_logprobs"] = msg.input_token_logprobs[i]
            if msg.output_token_logprobs[i] is not None:
                r["logprobs"] += [lp for lp, _ in msg.output_token_logprobs[i]]
    return results


def greedy(rid, ids, n, **kw) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid, list(ids), SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True), **kw)
