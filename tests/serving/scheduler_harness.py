"""Drive a Scheduler in-process on a real TpModelWorker (TP 1, CPU), capturing rank 0's outputs."""

from __future__ import annotations

from shardline_runtime.managers.io_struct import BatchTokenOut, TokenizedGenerateReqInput
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
        # as the event loop: admits compiled grammars, runs a pending weight update
        scheduler.process_input_requests(scheduler.recv_requests())
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
    delivered at iteration ``i`` (through the receiver, as from the socket, so rank 0's own
    messages such as ``GrammarsReady`` join them), until every message is delivered and it is
    idle."""
    last = max(arrivals, default=0)
    for step in range(max_steps):
        scheduler.receiver.backlog.extend(arrivals.get(step, []))
        scheduler.run_step(scheduler.recv_requests())
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
        if not isinstance(msg, BatchTokenOut):
            continue
        for out in msg.outs:
            r = results.setdefault(out.rid, {"ids": [], "finish": None, "chunks": 0, "prompt_logprobs": None,
                                             "cached": 0, "logprobs": []})
            r["ids"] += out.ids
            r["chunks"] += 1
            r["finish"] = out.finish.to_dict() if out.finish is not None else r["finish"]
            r["cached"] = out.usage.cached_tokens
            if out.prompt_logprobs is not None:
                r["prompt_logprobs"] = [(e.logprob, e.token_id) for e in out.prompt_logprobs]
            r["logprobs"] += [e.logprob for e in out.logprobs]
    return results


def greedy(rid, ids, n, **kw) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid=rid, input_ids=list(ids),
                                     sampling_params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
                                     **kw)
