"""The ControlPlane built alone over a real TpModelWorker (CPU, tiny checkpoint): it owns the
serving WeightsState and sends it whole on every change, waits for KV holders before an update,
refuses what cannot run, and pauses in SGLang's three modes."""

from __future__ import annotations

import pytest
import torch

from shardline_runtime.managers.control_plane import ControlPlane, PauseMode
from shardline_runtime.managers.io_struct import (
    AbortWeightUpdateReqInput,
    ControlReqOutput,
    FlushCacheReqOutput,
    PauseGenerationReqInput,
    ServingStateOut,
    UpdateWeightsFromDiskReqInput,
    UpdateWeightsFromDiskReqOutput,
    WeightUpdateCutoffReqInput,
)
from shardline_runtime.managers.req import Req
from shardline_runtime.managers.scheduler_output import OutputSender
from shardline_runtime.managers.tp_worker import TpModelWorker
from shardline_runtime.managers.watchdog import Watchdog
from shardline_runtime.managers.weight_update_run import initial_weights_state
from shardline_runtime.weights_state import WeightsPhase, WeightsState
from shardline_runtime.mem_cache.radix_cache import RadixCache
from shardline_runtime.model_loader.checkpoint_digest import checkpoint_digest
from shardline_runtime.sampling.sampling_params import SamplingParams
from shardline_runtime.server_args import ServerArgs


class Capture:
    def __init__(self):
        self.messages: list = []

    def send_pyobj(self, msg):
        self.messages.append(msg)


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoint):
    return tiny_checkpoint("llama", 0, max_position_embeddings=2048), tiny_checkpoint("llama", 1, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def worker(ckpts):
    args = ServerArgs(model_path=str(ckpts[0]), max_total_tokens=2048, device="cpu", disable_cuda_graph=True)
    return TpModelWorker(args, 0)


class Plane:
    """A ControlPlane with its collaborators as plain state the test sets."""

    def __init__(self, worker, path, abort_after_checks=None):
        self.abort_after_checks = abort_after_checks  # the abort arrives at this poll (None: never)
        self.abort_checks = 0
        self.holding_kv = False
        self.waiting: list = []
        self.aborted: list = []
        self.retracted = 0
        self.sender = OutputSender(Capture())
        self.part = ControlPlane(
            worker,
            RadixCache(worker.token_to_kv_pool_allocator.free),
            worker.model_runner.memory_saver,
            self.sender,
            Watchdog(60.0, 0),
            initial_weights_state(str(path), "rev-a", "v1", with_digest=True),
            abort=lambda rid, reason: self.aborted.append(rid),
            holds_kv=lambda: self.holding_kv,
            retract=self.retract,
            waiting=lambda: self.waiting,
            abort_requested=self.abort_requested,
        )

    def abort_requested(self) -> bool:
        self.abort_checks += 1
        return self.abort_after_checks is not None and self.abort_checks >= self.abort_after_checks

    def retract(self):
        self.retracted += 1

    def sent(self, kind) -> list:
        return [m for m in self.sender.socket.messages if isinstance(m, kind)]

    def update(self, **fields) -> None:
        self.part.start_weight_update(UpdateWeightsFromDiskReqInput(**fields))
        self.part.maybe_run_weight_update()


def test_the_state_at_start_carries_the_digest_of_the_loaded_checkpoint(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    assert plane.part.weights.digest == checkpoint_digest(str(ckpts[0]))


def test_a_disk_update_sends_loading_then_one_record_of_what_serves(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.update(model_path=str(ckpts[1]), revision="rev-b", weight_version="v2")
    states = plane.sent(WeightsState)
    assert [s.phase for s in states] == [WeightsPhase.LOADING, WeightsPhase.SERVING]
    final = states[-1]
    assert final.model_path == str(ckpts[1])
    assert final.revision == "rev-b"
    assert final.weight_version == "v2"
    assert final.digest == checkpoint_digest(str(ckpts[1]))
    assert final.last_update is not None and final.last_update.success
    assert plane.part.weights == final


def test_the_reply_follows_the_state_and_carries_the_phase_times(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.update(model_path=str(ckpts[0]), revision="rev-a")
    messages = plane.sender.socket.messages
    reply = messages[-1]
    assert isinstance(reply, UpdateWeightsFromDiskReqOutput)
    assert isinstance(messages[-2], WeightsState)
    assert reply.load_seconds == messages[-2].last_update.load_seconds


def test_a_failed_disk_update_reports_failed_and_keeps_what_served(worker, ckpts, tmp_path):
    plane = Plane(worker, ckpts[0])
    plane.update(model_path=str(tmp_path / "missing"), revision="rev-b", weight_version="v2")
    final = plane.part.weights
    assert final.phase is WeightsPhase.FAILED
    assert final.revision == "rev-a"
    assert final.weight_version == "v1"
    assert final.model_path == str(ckpts[0])
    assert final.last_update is not None and not final.last_update.success
    assert not plane.sent(UpdateWeightsFromDiskReqOutput)[0].success


def test_an_update_waits_while_a_request_holds_kv(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.holding_kv = True
    plane.update(model_path=str(ckpts[0]))
    assert plane.part.pending_update is not None
    assert plane.sent(UpdateWeightsFromDiskReqOutput) == []


def test_a_waiting_disk_update_stages_meanwhile_and_reports_loading(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.holding_kv = True
    plane.update(model_path=str(ckpts[0]))
    assert [s.phase for s in plane.sent(WeightsState)] == [WeightsPhase.LOADING]


def test_a_waiting_disk_update_commits_once_the_requests_are_done(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.holding_kv = True
    plane.update(model_path=str(ckpts[1]), revision="rev-b")
    plane.holding_kv = False
    plane.part.maybe_run_weight_update()
    assert plane.part.weights.revision == "rev-b"


def test_weights_staged_on_a_thread_commit_under_the_schedulers_inference_mode(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.holding_kv = True
    with torch.inference_mode():  # as scheduler_process runs the loop
        plane.update(model_path=str(ckpts[1]), revision="rev-b")
        plane.holding_kv = False
        plane.part.maybe_run_weight_update()
    assert plane.part.weights.revision == "rev-b"


@pytest.mark.parametrize("admitted_at, admitted", [(9.0, True), (11.0, False)])
def test_a_pending_disk_update_admits_only_requests_admitted_before_it(
    worker, ckpts, admitted_at, admitted
):
    plane = Plane(worker, ckpts[0])
    plane.holding_kv = True
    plane.part.start_weight_update(UpdateWeightsFromDiskReqInput(str(ckpts[0]), requested_at=10.0))
    req = Req("r", [1, 2], SamplingParams(), admitted_at=admitted_at)
    assert bool(plane.part.admits()(req)) is admitted


def test_a_pending_update_waits_for_a_queued_request_admitted_before_it(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.waiting.append(Req("before", [1, 2], SamplingParams(), admitted_at=9.0))
    plane.part.start_weight_update(UpdateWeightsFromDiskReqInput(str(ckpts[0]), requested_at=10.0))
    plane.part.maybe_run_weight_update()
    assert plane.part.pending_update is not None


def test_an_update_in_its_admission_window_lets_every_waiting_request_start(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.holding_kv = True
    plane.part.start_weight_update(UpdateWeightsFromDiskReqInput(str(ckpts[0]), admit_seconds=1.0))
    admitted_late = Req("late", [1, 2], SamplingParams(), admitted_at=11.0)
    assert plane.part.admits()(admitted_late)


def test_an_update_in_its_admission_window_does_not_commit_before_the_cutoff(worker, ckpts):
    plane = Plane(worker, ckpts[1])
    plane.update(model_path=str(ckpts[0]), revision="rev-b", admit_seconds=1.0)  # nothing runs
    assert plane.part.pending_update is not None and plane.part.weights.revision == "rev-a"
    assert [s.phase for s in plane.sent(WeightsState)] == [WeightsPhase.LOADING]  # staging
    plane.part.handlers()[WeightUpdateCutoffReqInput](WeightUpdateCutoffReqInput(10.0))
    plane.part.maybe_run_weight_update()
    assert plane.part.pending_update is None and plane.part.weights.revision == "rev-b"


def test_after_the_cutoff_an_update_holds_requests_admitted_after_it(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.holding_kv = True
    plane.part.start_weight_update(UpdateWeightsFromDiskReqInput(str(ckpts[0]), admit_seconds=1.0))
    plane.part.handlers()[WeightUpdateCutoffReqInput](WeightUpdateCutoffReqInput(10.0))
    admits = plane.part.admits()
    before = Req("before", [1, 2], SamplingParams(), admitted_at=9.0)
    after = Req("after", [1, 2], SamplingParams(), admitted_at=11.0)
    assert admits(before) and not admits(after)


def test_a_cutoff_with_no_update_waiting_for_one_changes_nothing(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.holding_kv = True
    plane.part.start_weight_update(UpdateWeightsFromDiskReqInput(str(ckpts[0]), requested_at=10.0))
    plane.part.handlers()[WeightUpdateCutoffReqInput](WeightUpdateCutoffReqInput(20.0))
    assert plane.part.pending_update.requested_at == 10.0


def test_an_update_with_abort_all_requests_aborts_every_request(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.holding_kv = True
    plane.update(model_path=str(ckpts[0]), abort_all_requests=True)
    assert plane.aborted == [None]


def test_an_update_is_refused_while_paused_in_place_with_requests_holding_kv(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.holding_kv = True
    plane.part.pause_generation(PauseGenerationReqInput("in_place"))
    plane.update(model_path=str(ckpts[0]))
    reply = plane.sent(UpdateWeightsFromDiskReqOutput)[0]
    assert not reply.success
    assert "paused in_place" in reply.message
    assert reply.load_seconds is None


def test_a_second_update_is_refused_while_one_is_pending(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.holding_kv = True
    plane.update(model_path=str(ckpts[0]))
    plane.update(model_path=str(ckpts[1]))
    assert plane.sent(UpdateWeightsFromDiskReqOutput)[0].message == "a weight update is already in progress"


def test_pause_with_an_unknown_mode_names_the_allowed_modes(worker, ckpts):
    ok, message = Plane(worker, ckpts[0]).part.pause_generation(PauseGenerationReqInput("later"))
    assert not ok
    assert message == "mode must be one of ['abort', 'retract', 'in_place'], got 'later'"


def test_pause_retract_retracts_replies_and_reports_the_serving_state(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.part.handlers()[PauseGenerationReqInput](PauseGenerationReqInput("retract"))
    assert plane.retracted == 1
    assert plane.part.paused is PauseMode.RETRACT
    assert plane.sent(ControlReqOutput)[0].success
    assert plane.sent(ServingStateOut) == [ServingStateOut(None, "retract")]


def test_flush_is_refused_while_requests_wait_unpaused(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.waiting.append(object())
    assert plane.part.flush_cache() == FlushCacheReqOutput(False, "requests are running or queued; flush when idle")


# --- abort of a disk update (issue 23: a revert cancels the load)


def _live_weight(worker):
    return worker.model_runner.model.model.embed_tokens.weight.detach().clone()


def test_an_abort_drops_a_queued_update_and_its_reply_says_aborted(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.holding_kv = True  # the update waits for the running request
    plane.update(model_path=str(ckpts[1]), revision="rev-b")
    plane.part.abort_weight_update(AbortWeightUpdateReqInput())
    assert plane.sent(UpdateWeightsFromDiskReqOutput)[0].aborted


def test_an_aborted_queued_update_never_runs(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.holding_kv = True
    plane.update(model_path=str(ckpts[1]), revision="rev-b")
    plane.part.abort_weight_update(AbortWeightUpdateReqInput())
    plane.holding_kv = False
    plane.part.maybe_run_weight_update()
    assert len(plane.sent(UpdateWeightsFromDiskReqOutput)) == 1


def test_an_aborted_queued_update_keeps_the_live_weights(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.holding_kv = True
    before = _live_weight(worker)
    plane.update(model_path=str(ckpts[1] if worker.model_config.model_path == str(ckpts[0]) else ckpts[0]))
    plane.part.abort_weight_update(AbortWeightUpdateReqInput())
    assert _live_weight(worker).equal(before)


def test_an_abort_with_nothing_queued_sends_nothing(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.part.abort_weight_update(AbortWeightUpdateReqInput())
    assert plane.sender.socket.messages == []


def test_an_abort_while_the_weights_stage_replies_aborted(worker, ckpts):
    plane = Plane(worker, ckpts[0], abort_after_checks=1)  # seen while the scheduler waits for the staging
    plane.update(model_path=str(ckpts[1]), revision="rev-b")
    assert plane.sent(UpdateWeightsFromDiskReqOutput)[0].aborted


def test_an_abort_while_the_weights_stage_stops_polling_at_once(worker, ckpts):
    plane = Plane(worker, ckpts[0], abort_after_checks=1)
    plane.update(model_path=str(ckpts[1]), revision="rev-b")
    assert plane.abort_checks <= 2  # the poll that saw it, and the last one before the vote


def test_an_abort_while_the_weights_stage_keeps_the_live_weights(worker, ckpts):
    plane = Plane(worker, ckpts[0], abort_after_checks=1)
    before = _live_weight(worker)
    plane.update(model_path=str(ckpts[1] if worker.model_config.model_path == str(ckpts[0]) else ckpts[0]))
    assert _live_weight(worker).equal(before)


def test_an_abort_while_the_weights_stage_ends_serving_what_served(worker, ckpts):
    plane = Plane(worker, ckpts[0], abort_after_checks=1)
    plane.update(model_path=str(ckpts[1]), revision="rev-b")
    final = plane.part.weights
    assert (final.phase, final.revision, final.digest) == (
        WeightsPhase.SERVING, "rev-a", checkpoint_digest(str(ckpts[0])))


def test_an_abort_at_the_last_check_before_the_commit_still_stops_the_update(worker, ckpts):
    plane = Plane(worker, ckpts[0])
    plane.holding_kv = True
    plane.update(model_path=str(ckpts[1]), revision="rev-b")
    staging = plane.part.staging
    plane.part.abort_requested = staging.done  # True only once the staging has ended
    plane.holding_kv = False
    plane.part.maybe_run_weight_update()
    assert plane.sent(UpdateWeightsFromDiskReqOutput)[0].aborted


def test_an_abort_while_requests_hold_cached_kv_keeps_the_cache_and_replies_aborted(worker, ckpts):
    # A revert or a drain (SIGTERM) aborts a queued update while the requests admitted before
    # it still run; flushing the prefix cache then raised and killed the scheduler (seen in the
    # fault suite: the deleted leader's in-flight requests and the update's reply were lost).
    plane = Plane(worker, ckpts[0])
    cache = plane.part.tree_cache
    slots = worker.token_to_kv_pool_allocator.alloc(4)
    cache.insert([1, 2, 3, 4], slots)
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(node)  # a running request uses these slots
    plane.holding_kv = True
    try:
        plane.update(model_path=str(ckpts[1]), revision="rev-b")
        plane.part.abort_weight_update(AbortWeightUpdateReqInput())
        assert plane.sent(UpdateWeightsFromDiskReqOutput)[0].aborted
        assert plane.part.weights.phase is WeightsPhase.SERVING
        assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == slots.tolist()
    finally:
        cache.dec_lock_ref(node)
        cache.reset()


def _cache_with_prefix(plane, worker):
    cache = plane.part.tree_cache
    slots = worker.token_to_kv_pool_allocator.alloc(4)
    cache.insert([1, 2, 3, 4], slots)
    return cache, slots


def test_a_rank_outvoted_by_an_abort_elsewhere_keeps_its_prefix_cache(worker, ckpts, monkeypatch):
    # On TP rank > 0 (or a later stage) the abort is seen only on rank 0, which votes no and keeps
    # its cache; this rank staged fine, loses the vote and must keep its cache too, or the TP
    # ranks hold different prefix caches and build different EXTEND batches.
    import shardline_runtime.model_executor.weight_update as weight_update

    monkeypatch.setattr(weight_update, "all_reduce_min_int", lambda value: 0)  # rank 0 voted no
    plane = Plane(worker, ckpts[0])
    cache, slots = _cache_with_prefix(plane, worker)
    try:
        plane.update(model_path=str(ckpts[1]), revision="rev-b")
        reply = plane.sent(UpdateWeightsFromDiskReqOutput)[0]
        assert not reply.success and not reply.aborted  # this rank never saw the abort
        assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == slots.tolist()
    finally:
        cache.reset()


@pytest.mark.parametrize("flush_cache", [True, False])
def test_a_successful_update_flushes_the_prefix_cache_unless_told_not_to(worker, ckpts, flush_cache):
    plane = Plane(worker, ckpts[0])
    cache, slots = _cache_with_prefix(plane, worker)
    try:
        plane.update(model_path=str(ckpts[0]), revision="rev-a", flush_cache=flush_cache)
        assert plane.sent(UpdateWeightsFromDiskReqOutput)[0].success
        kept = cache.match_prefix([1, 2, 3, 4])[0].tolist()
        assert kept == ([] if flush_cache else slots.tolist())
    finally:
        cache.reset()
