"""Scheduler side of weight sync, pause/continue and memory release (every rank in lockstep).

- Weight updates of every kind (disk, tensor, distributed) go through the Scheduler's one update
  path: ``start_weight_update`` queues the message, admission pauses, running requests finish
  (or are aborted with ``abort_all_requests``), then :meth:`run_weight_update` runs it on every
  rank and the prefix cache is flushed (unless ``flush_cache`` is false: a trainer sending
  buckets flushes on the last one).
- ``pause_generation`` (SGLang's modes): ``abort`` aborts every request; ``retract`` frees the KV
  of running requests and puts them back at the front of the queue (they are prefilled again,
  with whatever weights serve then); ``in_place`` keeps them and their KV. While paused no
  forward runs; new requests are held by the HTTP process until ``continue_generation``. A weight
  update while paused ``in_place`` with requests holding KV is refused (that KV came from the old
  weights).
- ``release_memory_occupation`` needs no request to hold KV (pause first); it flushes the prefix
  cache and frees memory (``model_executor/memory_saver.py``). Generation stays blocked until
  resumed and, after a release without CPU backup, until every tensor was written again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shardline_runtime.managers.io_struct import (
    ContinueGenerationReqInput,
    ControlReqOutput,
    DestroyWeightsUpdateGroupReqInput,
    GetWeightsByNameReqInput,
    InitWeightsUpdateGroupReqInput,
    PauseGenerationReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    ServingStateOut,
    UpdateWeightsFromDiskReqInput,
    UpdateWeightsFromDiskReqOutput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
)
from shardline_runtime.managers.weights_state import UpdateTimings
from shardline_runtime.managers.weights_state import WeightsPhase as StatePhase
from shardline_runtime.model_executor.memory_saver import MemorySaverError
from shardline_runtime.model_executor.weight_update import PhaseClock, WeightsPhase
from shardline_runtime.model_loader.checkpoint_digest import safe_checkpoint_digest

if TYPE_CHECKING:
    from shardline_runtime.managers.decode_manager import DecodeManager
    from shardline_runtime.managers.prefill_manager import PrefillManager
    from shardline_runtime.mem_cache.radix_cache import RadixCache

logger = logging.getLogger(__name__)

UPDATE_REQUESTS = (
    UpdateWeightsFromDiskReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromDistributedReqInput,
)
PAUSE_MODES = ("abort", "retract", "in_place")


class SchedulerWeightSyncMixin:
    """Controls of :class:`~shardline_runtime.managers.scheduler.Scheduler` beyond requests."""

    paused_mode: str | None = None
    last_serving_state: tuple = (None, None)
    update_timings: dict[str, float] | None = None  # the disk update just run (PhaseClock.seconds)
    # Set by Scheduler.__init__ (declared here for the type checker).
    tp_rank: int
    worker: Any
    tree_cache: RadixCache
    prefill_manager: PrefillManager
    decode_manager: DecodeManager
    pending_update: Any
    step_started: float | None
    send: Callable[[Any], None]
    send_weights_phase: Callable[[str], None]
    send_socket: Any
    weights_digest: str | None
    last_update: UpdateTimings | None
    abort_request: Callable[[str | None, dict], None]
    running_batches: Callable[[], list]
    running_mbs: list | None
    retract_idle_slots: Callable[[], None]

    # ------------------------------------------------------------------ state

    @property
    def memory_saver(self):
        return self.worker.model_runner.memory_saver

    def generation_blocked(self) -> bool:
        """No forward may run: paused, memory released, or weights missing after a resume."""
        return self.paused_mode is not None or self.memory_saver.blocked_reason() is not None

    def holds_kv(self) -> bool:
        return bool(self.running_batches()) or self.prefill_manager.chunked_req is not None

    def send_serving_state(self) -> None:
        state = (self.memory_saver.blocked_reason(), self.paused_mode)
        if state != self.last_serving_state:
            self.last_serving_state = state
            self.send(ServingStateOut(*state))

    def update_reply(self, msg: Any, ok: bool, message: str) -> Any:
        if isinstance(msg, UpdateWeightsFromDiskReqInput):
            timings, self.update_timings = (
                self.update_timings or {},
                None,
            )  # a refused update ran nothing
            return UpdateWeightsFromDiskReqOutput(
                ok,
                message,
                self.worker.weights_revision,
                self.worker.model_path,
                self.worker.weight_version,
                timings.get("load_seconds"),
                timings.get("recapture_seconds"),
            )
        return ControlReqOutput(ok, message, self.worker.weight_version)

    # ------------------------------------------------------------------ dispatch

    def handle_control(self, msg: Any) -> bool:
        """Run a non-update control message now; False when ``msg`` is not one."""
        handlers: dict[type, Callable[[Any], tuple]] = {
            InitWeightsUpdateGroupReqInput: lambda m: self.worker.init_weights_update_group(m),
            DestroyWeightsUpdateGroupReqInput: lambda m: self.worker.destroy_weights_update_group(
                m.group_name
            ),
            GetWeightsByNameReqInput: self.get_weights_by_name,
            PauseGenerationReqInput: self.pause_generation,
            ContinueGenerationReqInput: self.continue_generation,
            ReleaseMemoryOccupationReqInput: self.release_memory_occupation,
            ResumeMemoryOccupationReqInput: self.resume_memory_occupation,
        }
        handler = handlers.get(type(msg))
        if handler is None:
            return False
        self.step_started = None  # joining a group or gathering may outlast one step's watchdog
        result = handler(msg)
        ok, message = result[0], result[1]
        data = result[2] if len(result) > 2 else None
        self.send(ControlReqOutput(ok, message, self.worker.weight_version, data))
        self.send_serving_state()
        return True

    def start_weight_update(self, msg: Any) -> None:
        """Queue an update of any kind (``UPDATE_REQUESTS``); it runs once no request holds KV."""
        refused = (
            "a weight update is already in progress"
            if self.pending_update is not None
            else self.refuse_update(msg)
        )
        if refused:
            self.send(self.update_reply(msg, False, self.drain_refused_update(msg, refused)))
            return
        self.pending_update = msg
        if msg.abort_all_requests:
            self.abort_request(None, {"type": "abort", "message": "aborted for a weight update"})

    def maybe_run_weight_update(self) -> None:
        """Once no request runs (admission is paused meanwhile), load, flush the prefix cache, reply."""
        started = not self.generation_blocked() and any(
            r.output_ids for r in self.prefill_manager.waiting_queue
        )
        if self.running_batches() or self.prefill_manager.chunked_req is not None or started:
            # Retracted requests that began on the old weights finish on them too; paused with
            # ``retract`` (an RL loop's pause -> update -> continue) they resume on the new ones.
            return
        msg, self.pending_update = self.pending_update, None
        self.step_started = None  # loading a checkpoint may take longer than one step's watchdog
        self.send_weights_phase("loading")
        ok, message = self.run_weight_update(msg)
        if ok and (
            getattr(msg, "cuda_graph_max_bs", None) is not None
            or getattr(msg, "disable_cuda_graph", None) is not None
        ):
            started_graphs = time.monotonic()
            self.worker.update_cuda_graph_settings(
                msg.cuda_graph_max_bs,
                bool(msg.disable_cuda_graph),
                on_phase=self.report_update_phase,
            )
            if (
                self.update_timings is not None
            ):  # capturing with the new settings is recapture time too
                spent = time.monotonic() - started_graphs
                self.update_timings["recapture_seconds"] = (
                    self.update_timings.get("recapture_seconds", 0.0) + spent
                )
        # Old KV must never serve new weights; after a failed update the cache is still valid,
        # but flushing it costs only recomputation, so do it in every case (a trainer sending
        # buckets passes flush_cache false on all but the last).
        if msg.flush_cache:
            self.tree_cache.reset()
        if isinstance(msg, UpdateWeightsFromDiskReqInput):
            self.record_disk_update(msg, ok)
        phase = getattr(self.worker.weights_phase, "value", str(self.worker.weights_phase))
        self.send_weights_phase(phase)
        self.send(self.update_reply(msg, ok, message))
        self.send_serving_state()

    def report_update_phase(self, phase: WeightsPhase) -> None:
        """An update phase goes out as it begins; the end state goes out once, after the
        update, whole (with the new digest and the phase times)."""
        if StatePhase(phase.value).updating:
            self.send_weights_phase(phase.value)

    def record_disk_update(self, msg: UpdateWeightsFromDiskReqInput, ok: bool) -> None:
        """Rank 0: the outcome and phase times of the disk update just run, and (on success) the
        new checkpoint's digest, computed here where the weights were loaded."""
        if self.send_socket is None:
            return
        timings = self.update_timings or {}
        self.last_update = UpdateTimings(
            success=ok,
            model_path=msg.model_path,
            load_seconds=timings.get("load_seconds"),
            recapture_seconds=timings.get("recapture_seconds"),
        )
        if ok:
            self.weights_digest = safe_checkpoint_digest(self.worker.model_path)

    def refuse_update(self, msg: Any) -> str | None:
        """Why an update cannot be queued now, or None."""
        if self.paused_mode == "in_place" and self.holds_kv():
            return (
                "generation is paused in_place with requests holding KV computed by the old weights; "
                "pause with mode 'retract' or 'abort' before updating weights"
            )
        if self.memory_saver.released.intersection({"weights"}):
            return "weights are released; POST /resume_memory_occupation with tag 'weights' first"
        return None

    def drain_refused_update(self, msg: Any, refused: str) -> str:
        """The reply message for a refused update. A refused trainer update still receives (and
        discards) the broadcast the trainer sends anyway, so the trainer is not left blocked
        until its timeout (except while another update owns the group's broadcasts)."""
        if (
            not isinstance(msg, UpdateWeightsFromDistributedReqInput)
            or self.pending_update is not None
        ):
            return refused
        self.step_started = None  # receiving may outlast one step's watchdog
        return self.worker.update_weights_from_distributed(msg, refused=refused)[1]

    def run_weight_update(self, msg: Any) -> tuple[bool, str]:
        """Run a queued update of any kind on this rank (every rank together); sets
        ``weight_version`` and records the tensors written for the memory saver."""
        worker = self.worker
        if isinstance(msg, UpdateWeightsFromDiskReqInput):
            clock = PhaseClock(self.report_update_phase)
            ok, message = worker.update_weights_from_disk(
                msg.model_path,
                msg.load_format or "auto",
                msg.revision,
                msg.recapture_cuda_graph,
                on_phase=clock,
            )
            self.update_timings = clock.seconds()  # reported in the reply (update_reply)
            names = None
        elif isinstance(msg, UpdateWeightsFromTensorReqInput):
            ok, message, names = worker.update_weights_from_tensor(msg.serialized_named_tensors)
        else:
            ok, message, names = worker.update_weights_from_distributed(msg)
        if ok:
            if names is not None:  # a trainer's update: a disk update reports its own phases
                worker.weights_phase = WeightsPhase.SERVING
            self.memory_saver.note_loaded(names)
            if msg.weight_version is not None:
                worker.weight_version = msg.weight_version
        logger.info(
            "[tp %d] %s: %s %s (weight_version %s)",
            self.tp_rank,
            type(msg).__name__,
            ok,
            message,
            worker.weight_version,
        )
        return ok, message

    # ------------------------------------------------------------------ controls

    def get_weights_by_name(self, msg: GetWeightsByNameReqInput) -> tuple:
        if "weights" in self.memory_saver.released:
            return False, "weights are released; POST /resume_memory_occupation first"
        from shardline_runtime.model_executor.weight_update import WeightUpdateError

        try:
            return (
                True,
                f"first {msg.truncate_size} rows of {msg.name}",
                self.worker.get_weights_by_name(msg.name, msg.truncate_size),
            )
        except WeightUpdateError as exc:
            return False, str(exc)

    def pause_generation(self, msg: PauseGenerationReqInput) -> tuple[bool, str]:
        if msg.mode not in PAUSE_MODES:
            return False, f"mode must be one of {list(PAUSE_MODES)}, got {msg.mode!r}"
        if msg.mode == "abort":
            self.abort_request(None, {"type": "abort", "message": "aborted by /pause_generation"})
        elif msg.mode == "retract":
            while self.decode_manager.is_running():
                self.prefill_manager.requeue(self.decode_manager.retract_one())
            if self.running_mbs is not None:  # pipeline micro-batch slots
                self.retract_idle_slots()
            self.prefill_manager.retract_chunked()
        self.paused_mode = msg.mode
        return True, f"generation paused ({msg.mode})"

    def continue_generation(self, _msg: ContinueGenerationReqInput) -> tuple[bool, str]:
        was, self.paused_mode = self.paused_mode, None
        return True, "generation continues" if was else "generation was not paused"

    def release_memory_occupation(self, msg: ReleaseMemoryOccupationReqInput) -> tuple[bool, str]:
        if self.holds_kv() or self.pending_update is not None:
            return False, (
                "requests are running; POST /pause_generation (mode 'abort' or 'retract') or let them "
                "finish before releasing memory"
            )
        try:
            self.tree_cache.reset()  # its KV is about to be freed
            return True, self.memory_saver.release(msg.tags)
        except MemorySaverError as exc:
            return False, str(exc)

    def resume_memory_occupation(self, msg: ResumeMemoryOccupationReqInput) -> tuple[bool, str]:
        try:
            return True, self.memory_saver.resume(msg.tags)
        except MemorySaverError as exc:
            return False, str(exc)
