"""The host-work caches of the scheduler loop give what computing afresh gives.

- A running batch's decode record (``managers/decode_record.py``): the ``ModelWorkerBatch`` and
  ``ForwardBatch`` advanced in place for a DECODE step of unchanged rows equal the ones built
  from scratch, at every step of a workload whose rows join, finish, are aborted and are
  retracted, with and without overlap scheduling.
- The stats report (``managers/stats_report.py``): after every iteration the last stats sent
  carry the request counts computed afresh, and a change of the counts goes out in the
  iteration it happens.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from scheduler_harness import greedy, make_scheduler

from shardline_runtime.managers.io_struct import AbortReq, BatchTokenOut, SchedulerStats
from shardline_runtime.managers.model_worker_batch import ModelWorkerBatch
from shardline_runtime.managers.schedule_batch import ScheduleBatch

WORKER_FIELDS = [f.name for f in dataclasses.fields(ModelWorkerBatch) if f.name != "host_forward_batch"]
FORWARD_FIELDS = ["forward_mode", "batch_size", "input_ids", "positions", "req_pool_indices", "seq_lens",
                  "out_cache_loc", "seq_lens_cpu", "return_logprob", "top_logprobs_nums", "sampling_info",
                  "wants_token", "return_logprobs", "lora_names", "grammar_bitmask"]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama", 0, max_position_embeddings=2048)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 500) for _ in range(n)]


def _differences(got, fresh, names) -> list[str]:
    out = []
    for name in names:
        a, b = getattr(got, name), getattr(fresh, name)
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b
        if not same:
            out.append(f"{name}: {a!r} != {b!r}")
    return out


class FreshComparison:
    """Spies on the real methods: each ``ModelWorkerBatch`` and each CPU decode ``ForwardBatch``
    the loop builds is compared with one built from scratch (no record, ``ForwardBatch.init_new``)."""

    def __init__(self, monkeypatch):
        self.reused = self.built = 0
        self.mismatches: list[str] = []
        worker_batch, forward_batch = ScheduleBatch.get_model_worker_batch, ModelWorkerBatch.to_forward_batch

        def spy_worker_batch(batch: ScheduleBatch) -> ModelWorkerBatch:
            record = batch._decode_record
            reusing = record is not None and record.reqs is batch.reqs and batch.forward_mode.is_decode()
            got = worker_batch(batch)
            kept, batch._decode_record = batch._decode_record, None
            fresh = worker_batch(batch)
            batch._decode_record = kept
            self.reused += reusing
            self.built += not reusing
            self.mismatches += [f"ModelWorkerBatch {d}" for d in _differences(got, fresh, WORKER_FIELDS)]
            return got

        def spy_forward_batch(batch: ModelWorkerBatch, model_runner=None, device=None):
            got = forward_batch(batch, model_runner, device)
            if device is None and batch.forward_mode.is_decode():
                fresh = forward_batch(dataclasses.replace(batch, host_forward_batch=None), model_runner, "cpu")
                self.mismatches += [f"ForwardBatch {d}" for d in _differences(got, fresh, FORWARD_FIELDS)]
            return got

        monkeypatch.setattr(ScheduleBatch, "get_model_worker_batch", spy_worker_batch)
        monkeypatch.setattr(ModelWorkerBatch, "to_forward_batch", spy_forward_batch)


def _run(scheduler, arrivals: dict[int, list], steps_after: int = 2000) -> None:
    last = max(arrivals)
    for step in range(last + steps_after):
        scheduler.receiver.backlog.extend(arrivals.get(step, []))
        scheduler.run_step(scheduler.recv_requests())
        scheduler.send_stats()
        if step >= last and scheduler.is_idle():
            return
    raise AssertionError("scheduler did not finish")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_reused_decode_record_equals_a_fresh_one_as_rows_join_finish_and_are_aborted(ckpt, monkeypatch, overlap):
    rng = random.Random(0)
    arrivals = {
        0: [greedy("a", _prompt(rng, 30), 40), greedy("b", _prompt(rng, 12), 6)],
        5: [greedy("c", _prompt(rng, 50), 30, return_logprob=True, top_logprobs_num=2)],
        9: [greedy("d", _prompt(rng, 8), 1)],
        20: [AbortReq("a")],
    }
    compare = FreshComparison(monkeypatch)
    _run(make_scheduler(ckpt, disable_overlap_schedule=not overlap), arrivals)
    assert compare.mismatches == []
    assert compare.reused > 10, "steady decode steps reused the record"
    assert compare.built > 3, "joins, finishes and the abort built new records"


def test_a_reused_decode_record_equals_a_fresh_one_across_retractions(ckpt, monkeypatch):
    rng = random.Random(2)
    arrivals = {0: [greedy(f"r{i}", _prompt(rng, rng.randint(20, 40)), 40) for i in range(8)]}
    compare = FreshComparison(monkeypatch)
    scheduler = make_scheduler(ckpt, max_total_tokens=256, disable_radix_cache=True)
    _run(scheduler, arrivals)
    assert scheduler.decode_manager.num_retractions > 0
    assert compare.mismatches == []
    assert compare.reused > 0


def _counts(stats: SchedulerStats) -> tuple[int, int]:
    return stats.num_running_reqs, stats.num_queued_reqs


def test_the_stats_sent_carry_the_current_request_counts_after_every_iteration(ckpt):
    rng = random.Random(1)
    arrivals = {
        0: [greedy("a", _prompt(rng, 20), 30)],
        3: [greedy("b", _prompt(rng, 20), 5), greedy("c", _prompt(rng, 20), 12)],
        12: [AbortReq("a")],
        14: [greedy("d", _prompt(rng, 20), 3)],
    }
    scheduler = make_scheduler(ckpt)
    report = scheduler.stats_report
    computed = [0]
    current = report.current

    def counting() -> SchedulerStats:
        computed[0] += 1
        return current()

    report.current = counting
    stale, iterations = [], 0
    for step in range(2000):
        scheduler.receiver.backlog.extend(arrivals.get(step, []))
        scheduler.run_step(scheduler.recv_requests())
        scheduler.send_stats()
        iterations += 1
        sent = scheduler.sender.last_stats
        if sent is None or _counts(sent) != _counts(current()):
            stale.append((step, None if sent is None else _counts(sent), _counts(current())))
        if step >= max(arrivals) and scheduler.is_idle():
            break
    assert stale == [], "(iteration, counts sent, counts now)"
    assert computed[0] < iterations, "steady iterations skipped computing the report"


def test_a_finished_request_leaves_the_running_count_in_the_iteration_its_finish_is_sent(ckpt):
    rng = random.Random(3)
    scheduler = make_scheduler(ckpt)
    scheduler.receiver.backlog.extend([greedy("short", _prompt(rng, 10), 4), greedy("long", _prompt(rng, 10), 40)])
    messages = scheduler.sender.socket.messages
    for _ in range(40):
        scheduler.run_step(scheduler.recv_requests())
        scheduler.send_stats()
        if any(isinstance(m, BatchTokenOut) and any(o.rid == "short" and o.finish for o in m.outs) for m in messages):
            break
    else:
        raise AssertionError("the short request did not finish")
    assert scheduler.sender.last_stats.num_running_reqs == 1
