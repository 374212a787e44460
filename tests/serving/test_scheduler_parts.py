"""Each part of the scheduler built and tested alone, without a model (as test_schedule_policy.py
does for the policy objects): the message table, the output sender, result processing, the batch
planner across micro-batch slots, the pipeline loop's slot rotation, request intake and the
watchdog. The ControlPlane, which needs a real worker, is in test_control_plane.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_schedule_policy import finish_extend, limits, make_cache, managers, req

from shardline_runtime.managers.batch_planner import BatchPlanner
from shardline_runtime.managers.decode_manager import DecodeManager
from shardline_runtime.managers.dispatcher import TypeBasedDispatcher
from shardline_runtime.managers.io_struct import BatchTokenOut, SchedulerStats, TokenizedGenerateReqInput
from shardline_runtime.managers.pipeline_loop import PipelineLoop
from shardline_runtime.managers.request_intake import RequestIntake
from shardline_runtime.managers.result_processor import ResultProcessor
from shardline_runtime.managers.schedule_policy import NewTokenRatio
from shardline_runtime.managers.scheduler_output import KV_STATS_INTERVAL_S, OutputSender
from shardline_runtime.managers.token_out import build_token_outs
from shardline_runtime.managers.watchdog import Watchdog
from shardline_runtime.model_executor.generation_result import GenerationBatchResult
from shardline_runtime.sampling import SamplingParams


class Capture:
    def __init__(self):
        self.messages: list = []

    def send_pyobj(self, msg):
        self.messages.append(msg)


def capturing_sender() -> OutputSender:
    return OutputSender(Capture())


def sampled(*ids: int) -> GenerationBatchResult:
    return GenerationBatchResult(None, None, next_token_ids=torch.tensor(ids))


def token_outputs(sender: OutputSender) -> list[BatchTokenOut]:
    return [m for m in sender.socket.messages if isinstance(m, BatchTokenOut)]


# ---------------------------------------------------------------- TypeBasedDispatcher


class Parent:
    pass


class Child(Parent):
    pass


def test_dispatcher_calls_the_handler_registered_for_the_message_type():
    seen = []
    dispatch = TypeBasedDispatcher({int: seen.append})
    assert dispatch(3)
    assert seen == [3]


def test_dispatcher_routes_a_subclass_to_the_handler_of_its_base():
    seen = []
    TypeBasedDispatcher({Parent: seen.append})(child := Child())
    assert seen == [child]


def test_dispatcher_reports_a_message_no_handler_takes():
    assert not TypeBasedDispatcher({int: print})("text")


def test_two_parts_registering_the_same_type_are_refused():
    with pytest.raises(ValueError, match="two handlers for int"):
        TypeBasedDispatcher.merge({int: print}, {int: print})


# ---------------------------------------------------------------- OutputSender


def test_a_rank_without_a_socket_sends_nothing_and_marks_nothing_sent():
    r = req("a", 3)
    r.append_output(7)
    OutputSender(None).stream([r])
    assert r.sent_len == 0


def test_stats_are_sent_only_when_they_change():
    sender = capturing_sender()
    for running in (1, 1, 2):
        sender.send_stats(SchedulerStats(running, 0, 0, 0, 100))
    assert [m.num_running_reqs for m in sender.socket.messages] == [1, 2]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def kv_stats(running: int, used: int) -> SchedulerStats:
    return SchedulerStats(running, 0, used, 0, 100)


def test_a_kv_only_change_within_the_interval_is_held_back():
    clock = Clock()
    sender = OutputSender(Capture(), clock=clock)
    sender.send_stats(kv_stats(1, 10))
    clock.now += KV_STATS_INTERVAL_S / 2
    sender.send_stats(kv_stats(1, 11))
    assert [m.kv_used_tokens for m in sender.socket.messages] == [10]


def test_a_held_kv_change_goes_out_once_the_interval_passed():
    clock = Clock()
    sender = OutputSender(Capture(), clock=clock)
    sender.send_stats(kv_stats(1, 10))
    sender.send_stats(kv_stats(1, 11))
    clock.now += 2 * KV_STATS_INTERVAL_S
    sender.send_stats(kv_stats(1, 12))
    assert [m.kv_used_tokens for m in sender.socket.messages] == [10, 12]


def test_a_request_count_change_is_sent_at_once():
    sender = OutputSender(Capture(), clock=Clock())
    sender.send_stats(kv_stats(2, 10))
    sender.send_stats(kv_stats(1, 11))
    assert [m.num_running_reqs for m in sender.socket.messages] == [2, 1]


def test_a_kv_change_with_nothing_running_is_sent_at_once():
    sender = OutputSender(Capture(), clock=Clock())
    sender.send_stats(SchedulerStats(0, 0, 10, 5, 100))
    sender.send_stats(SchedulerStats(0, 0, 0, 5, 100))
    assert [m.kv_used_tokens for m in sender.socket.messages] == [10, 0]


def test_token_output_is_none_when_no_request_has_news():
    assert build_token_outs([req("a", 3)]) == []


def test_token_output_sends_each_new_token_once():
    r = req("a", 3)
    r.append_output(7)
    first = build_token_outs([r])
    r.append_output(8)
    second = build_token_outs([r])
    assert ([o.ids for o in first], [o.ids for o in second]) == ([[7]], [[8]])


def test_a_rejected_request_ends_with_an_abort_naming_the_reason():
    sender = capturing_sender()
    sender.reject("a", 0, "the prompt has 0 tokens")
    assert [o.finish.to_dict() for o in token_outputs(sender)[0].outs] == [
        {"type": "abort", "message": "the prompt has 0 tokens"}]


# ---------------------------------------------------------------- ResultProcessor


def extend_of(cache, prefill, *reqs):
    for r in reqs:
        prefill.add(r)
    return prefill.schedule([])


def test_an_extend_result_moves_its_requests_into_the_decode_manager():
    cache = make_cache()
    prefill, decode = managers(cache, limits())
    sender = capturing_sender()
    batch = extend_of(cache, prefill, req("a", 4), req("b", 4))
    ResultProcessor(cache, decode, 256, sender).process(batch, sampled(7, 8))
    assert [r.rid for r in decode.running_reqs] == ["a", "b"]
    assert [o.ids for o in token_outputs(sender)[0].outs] == [[7], [8]]


def test_a_request_at_max_new_tokens_finishes_with_length_and_frees_its_kv():
    cache = make_cache()
    prefill, decode = managers(cache, limits())
    batch = extend_of(cache, prefill, r := req("a", 4, max_new_tokens=1))
    ResultProcessor(cache, decode, 256, capturing_sender()).process(batch, sampled(7))
    assert r.finished_reason.type == "length"
    assert decode.running_reqs == []
    assert cache.used_tokens() == 0


def test_a_result_joins_the_decode_manager_of_its_micro_batch_slot():
    cache = make_cache()
    prefill, first = managers(cache, limits())
    second = DecodeManager(cache, NewTokenRatio(), 256)
    batch = extend_of(cache, prefill, req("a", 4))
    ResultProcessor(cache, first, 256, capturing_sender()).process(batch, sampled(7), second)
    assert [r.rid for r in second.running_reqs] == ["a"]
    assert first.running_reqs == []


# ---------------------------------------------------------------- BatchPlanner


def two_slot_planner(max_running: int = 8, in_flight: list | None = None):
    cache = make_cache()
    prefill, first = managers(cache, limits(max_running_requests=max_running))
    slots = [first, DecodeManager(cache, NewTokenRatio(), 256)]
    sender = capturing_sender()
    flying = in_flight if in_flight is not None else []
    planner = BatchPlanner(prefill, slots, NewTokenRatio(), sender, max_running, in_flight=lambda: flying)
    return cache, prefill, slots, sender, planner


def test_a_running_batch_also_in_flight_is_listed_once():
    in_flight: list = []
    cache, prefill, slots, _, planner = two_slot_planner(in_flight=in_flight)
    finish_extend(extend_of(cache, prefill, req("a", 4)), slots[0])
    in_flight.append(slots[0].running_batch)
    assert planner.running_batches() == [slots[0].running_batch]


def test_abort_all_finishes_the_requests_of_every_slot_and_frees_their_kv():
    cache, prefill, slots, sender, planner = two_slot_planner()
    finish_extend(extend_of(cache, prefill, req("a", 4)), slots[0])
    finish_extend(extend_of(cache, prefill, req("b", 4)), slots[1])
    planner.abort(None, {"type": "abort", "message": "stop"})
    assert planner.running_batches() == []
    assert cache.used_tokens() == 0
    assert sorted(o.rid for o in token_outputs(sender)[0].outs) == ["a", "b"]


def test_an_aborted_batch_in_flight_keeps_its_rows_until_its_result():
    in_flight: list = []
    cache, prefill, slots, _, planner = two_slot_planner(in_flight=in_flight)
    finish_extend(extend_of(cache, prefill, req("a", 4)), slots[0])
    in_flight.append(slots[0].running_batch)
    planner.abort("a", {"type": "abort"})
    assert [r.rid for r in slots[0].running_batch.reqs] == ["a"]
    assert slots[0].running_batch.reqs[0].finished()


def test_each_slot_admits_at_most_its_share_of_max_running_requests():
    cache, prefill, slots, _, planner = two_slot_planner(max_running=2)
    for rid in "abc":
        prefill.add(req(rid, 4))
    batch = planner.next_batch(slots[0])
    assert [r.rid for r in batch.reqs] == ["a"]


def test_running_requests_decode_while_a_new_request_arrives_before_every_step():
    # Issue 23's stall after a weight update: a forward slower than the gap between arrivals
    # found a new request waiting at every step, so EXTEND always came first and the running
    # requests never produced another token until the client stopped sending.
    cache = make_cache(kv_slots=4000, rows=64)  # room enough that admission never stops
    prefill, decode = managers(cache, limits(max_running_requests=64))
    planner = BatchPlanner(prefill, [decode], NewTokenRatio(), capturing_sender(), 64)
    finish_extend(extend_of(cache, prefill, req("first", 4)), decode)
    kinds = []
    for step in range(8):
        prefill.add(req(f"new-{step}", 4, first_token=100 + step))
        batch = planner.next_batch(decode)
        kinds.append(batch.forward_mode.name)
        if batch.forward_mode.is_extend():
            finish_extend(batch, decode)
        else:
            for r in batch.reqs:
                r.append_output(6)
    assert kinds.count("DECODE") >= 4, kinds


def test_an_extend_still_comes_first_when_nothing_sat_one_out():
    cache, prefill, slots, _, planner = two_slot_planner(max_running=8)
    prefill.add(req("a", 4))
    assert planner.next_batch(slots[0]).forward_mode.name == "EXTEND"


def test_retracting_idle_slots_leaves_a_batch_in_flight_alone():
    in_flight: list = []
    cache, prefill, slots, _, planner = two_slot_planner(in_flight=in_flight)
    finish_extend(extend_of(cache, prefill, req("a", 4)), slots[0])
    finish_extend(extend_of(cache, prefill, req("b", 4)), slots[1])
    in_flight.append(slots[1].running_batch)
    planner.retract_idle_slots()
    assert [r.rid for r in prefill.waiting_queue] == ["a"]
    assert [r.rid for r in slots[1].running_reqs] == ["b"]


# ---------------------------------------------------------------- PipelineLoop


def test_each_micro_batch_is_processed_one_iteration_later_into_its_own_slot():
    cache = make_cache()
    slots = [DecodeManager(cache, NewTokenRatio(), 256) for _ in range(2)]
    worker = SimpleNamespace(
        is_last_stage=True,
        forward_batch_generation=lambda mwb: f"result of {mwb}",
        resolve_stage_outputs=lambda result: result,
    )
    scheduled = iter(range(3))
    processed = []

    def schedule(decode):
        n = next(scheduled)
        return SimpleNamespace(get_model_worker_batch=lambda: n, slot=slots.index(decode))

    loop = PipelineLoop(worker, slots, list, lambda messages: None, schedule,
                        lambda batch, result, decode: processed.append((result, slots.index(decode))))
    for _ in range(3):
        loop.step()
    assert processed == [("result of 0", 0), ("result of 1", 1)]
    assert len(loop.batches_in_flight()) == 1


# ---------------------------------------------------------------- RequestIntake


def intake(lora=None):
    sender, queued = capturing_sender(), []
    return RequestIntake(100, 200, [2], lora, sender, queued.append), sender, queued


def test_intake_clips_max_new_tokens_to_the_room_left_in_a_request():
    part, _, queued = intake()
    part.handle(TokenizedGenerateReqInput(rid="a", input_ids=[1] * 50, sampling_params=SamplingParams(max_new_tokens=1000)))
    assert queued[0].sampling_params.max_new_tokens == 150


def test_intake_answers_an_empty_prompt_with_the_accepted_lengths():
    part, sender, queued = intake()
    part.handle(TokenizedGenerateReqInput(rid="a", input_ids=[], sampling_params=SamplingParams(max_new_tokens=4)))
    assert queued == []
    assert token_outputs(sender)[0].outs[0].finish.message == (
        "the prompt has 0 tokens; this server accepts 1 to 100"
    )


def test_intake_refuses_an_adapter_when_lora_is_off():
    part, sender, queued = intake()
    part.handle(TokenizedGenerateReqInput(rid="a", input_ids=[1, 2], sampling_params=SamplingParams(max_new_tokens=4),
                                          lora_name="x"))
    assert queued == []
    assert token_outputs(sender)[0].outs[0].finish.message == "LoRA adapter 'x' is not loaded"


# ---------------------------------------------------------------- Watchdog


def test_the_watchdog_counts_only_a_step_that_runs_past_its_limit():
    dog = Watchdog(limit=10.0, tp_rank=0)
    dog.step_started = 100.0
    assert not dog.overdue(105.0)
    assert dog.overdue(111.0)
    dog.end()
    assert not dog.overdue(1000.0)
