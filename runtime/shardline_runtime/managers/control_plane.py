"""The scheduler's control plane: weight updates, pause/continue, memory release, the serving
weights' state (every rank in lockstep; rank 0 replies).

- Weight updates of every kind (disk, tensor, distributed) take one path: :meth:`ControlPlane.
  start_weight_update` queues the message; the requests that arrived before it (a disk update's
  ``requested_at``; for a trainer's, none) and the started ones finish (or are aborted with
  ``abort_all_requests``), then :meth:`ControlPlane.maybe_run_weight_update` runs it on every
  rank and, if it succeeded, the prefix cache is flushed (unless ``flush_cache`` is false: a
  trainer sending buckets flushes on the last one). A disk update stages its new weights on a thread of its own
  meanwhile (``weight_staging.BackgroundStaging``), so the pause covers only the commit (vote,
  copy) and the recapture; requests arriving after it are held by the HTTP process (after its
  admission window, ``admit_seconds``: ``weight_update_run.update_admits``).
- A disk update can be aborted (``AbortWeightUpdateReqInput``, ``POST /abort_weight_update``)
  while it stages the new weights (every rank stops its staging and votes no at once; while
  the scheduler waits for the staging to end, rank 0 looks for the abort on its input and votes
  no); its reply then says ``aborted`` and the old weights keep serving (phase ``serving``),
  their prefix cache kept (the abort may come while requests still hold KV). An abort that comes
  after the commit changes nothing.
- The control plane owns the live :class:`WeightsState` (model path, revision, weight_version,
  phase, digest, last update's timings). Every change is a new record, sent whole to the HTTP
  process (after SGLang's one ``weight_version`` recorded in one place). The digest is computed
  here, where the weights were loaded, by rank 0 only.
- ``pause_generation`` (SGLang's modes, :class:`PauseMode`): ``abort`` aborts every request;
  ``retract`` frees the KV of running requests and puts them back at the front of the queue
  (they are prefilled again, with whatever weights serve then); ``in_place`` keeps them and their
  KV. While paused no forward runs; new requests are held by the HTTP process until
  ``continue_generation``. A weight update while paused ``in_place`` with requests holding KV is
  refused (that KV came from the old weights).
- ``release_memory_occupation`` needs no request to hold KV (pause first); it flushes the prefix
  cache and frees memory (``model_executor/memory_saver.py``). Generation stays blocked until
  resumed and, after a release without CPU backup, until every tensor was written again.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from typing import Any

from shardline_runtime.managers.dispatcher import Handler
from shardline_runtime.managers.io_struct import (
    AbortWeightUpdateReqInput,
    ContinueGenerationReqInput,
    ControlReqOutput,
    DestroyWeightsUpdateGroupReqInput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
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
    WeightUpdateCutoffReqInput,
)
from shardline_runtime.managers.req import Req
from shardline_runtime.managers.scheduler_output import OutputSender
from shardline_runtime.managers.watchdog import Watchdog
from shardline_runtime.managers.weight_update_run import (
    awaiting_cutoff,
    cut_off,
    run_weight_update,
    start_staging,
    update_admits,
)
from shardline_runtime.mem_cache.radix_cache import RadixCache
from shardline_runtime.model_executor.memory_saver import MemorySaver, MemorySaverError
from shardline_runtime.model_executor.weight_staging import BackgroundStaging, WeightUpdateError
from shardline_runtime.weights_state import UpdateTimings, WeightsPhase, WeightsState

logger = logging.getLogger(__name__)

UPDATE_REQUESTS = (
    UpdateWeightsFromDiskReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromDistributedReqInput,
)


class PauseMode(str, enum.Enum):
    """``/pause_generation`` modes (SGLang's): what happens to the running requests."""

    ABORT = "abort"
    RETRACT = "retract"
    IN_PLACE = "in_place"


class ControlPlane:
    """Weight updates, pause/continue and memory release for one rank.

    Args:
        worker: the rank's ``TpModelWorker`` (runs the updates).
        tree_cache: the prefix cache (flushed after an update and before a release).
        memory_saver: the runner's ``MemorySaver``.
        sender: rank 0's :class:`OutputSender` (replies, the weights state, the serving state).
        watchdog: the loop's :class:`Watchdog` (long controls are not timed).
        weights: the :class:`WeightsState` serving at start.
        abort: ``abort(rid, reason)``; ``rid`` None aborts every request.
        holds_kv: True while a running or chunked request holds KV.
        retract: retract every running request (and the chunked one) back to the queue.
        waiting: the waiting queue.
        tp_rank: for the logs.
        abort_requested: True when an ``AbortWeightUpdateReqInput`` arrived while an update
            runs (rank 0: ``RequestReceiver.take``; every other rank: never).

    Attributes:
        paused: the pause mode, or None.
        pending_update: a queued update (one of ``UPDATE_REQUESTS``), or None.
        weights: the live :class:`WeightsState`.
    """

    def __init__(
        self,
        worker: Any,
        tree_cache: RadixCache,
        memory_saver: MemorySaver,
        sender: OutputSender,
        watchdog: Watchdog,
        weights: WeightsState,
        abort: Callable[[str | None, dict], None],
        holds_kv: Callable[[], bool],
        retract: Callable[[], None],
        waiting: Callable[[], Sequence[Req]],
        tp_rank: int = 0,
        abort_requested: Callable[[], bool] = lambda: False,
    ):
        self.worker = worker
        self.tree_cache = tree_cache
        self.memory_saver = memory_saver
        self.sender = sender
        self.watchdog = watchdog
        self.weights = weights
        self.abort = abort
        self.holds_kv = holds_kv
        self.retract = retract
        self.waiting = waiting
        self.tp_rank = tp_rank
        self.abort_requested = abort_requested
        self.paused: PauseMode | None = None
        self.pending_update: Any = None
        self.staging: BackgroundStaging | None = None  # the pending disk update's
        self.last_serving_state: tuple[str | None, str | None] = (None, None)

    def handlers(self) -> dict[type, Handler]:
        """This part's entries of the scheduler's message table."""
        table: dict[type, Handler] = {t: self.start_weight_update for t in UPDATE_REQUESTS}
        table[FlushCacheReqInput] = lambda _msg: self.sender.send(self.flush_cache())
        table[AbortWeightUpdateReqInput] = self.abort_weight_update
        table[WeightUpdateCutoffReqInput] = lambda m: cut_off(self.pending_update, m.requested_at)
        controls: dict[type, Callable[[Any], tuple]] = {
            InitWeightsUpdateGroupReqInput: self.worker.init_weights_update_group,
            DestroyWeightsUpdateGroupReqInput: lambda m: self.worker.destroy_weights_update_group(
                m.group_name
            ),
            GetWeightsByNameReqInput: self.get_weights_by_name,
            PauseGenerationReqInput: self.pause_generation,
            ContinueGenerationReqInput: self.continue_generation,
            ReleaseMemoryOccupationReqInput: self.release_memory_occupation,
            ResumeMemoryOccupationReqInput: self.resume_memory_occupation,
        }
        for msg_type, control in controls.items():
            table[msg_type] = self._replying(control)
        return table

    def _replying(self, control: Callable[[Any], tuple]) -> Handler:
        def handle(msg: Any) -> None:
            self.watchdog.end()  # joining a group or gathering may outlast one step's watchdog
            result = control(msg)
            data = result[2] if len(result) > 2 else None
            self.sender.send(ControlReqOutput(result[0], result[1], data=data))
            self.send_serving_state()

        return handle

    # ------------------------------------------------------------------ state

    def generation_blocked(self) -> bool:
        """No forward may run: paused, memory released, or weights missing after a resume."""
        return self.paused is not None or self.memory_saver.blocked_reason() is not None

    def send_serving_state(self) -> None:
        paused = None if self.paused is None else self.paused.value
        state = (self.memory_saver.blocked_reason(), paused)
        if state != self.last_serving_state:
            self.last_serving_state = state
            self.sender.send(ServingStateOut(*state))

    def publish(self, **changes: Any) -> None:
        """Replace the live :class:`WeightsState` by one with ``changes``; send it when it
        differs from the last one."""
        state = self.weights.model_copy(update=changes)
        if state != self.weights:
            self.weights = state
            self.sender.send(state)

    def flush_cache(self) -> FlushCacheReqOutput:
        # Requests waiting while generation is paused hold no KV (SGLang: flushable after a retract).
        if (
            self.holds_kv()
            or self.pending_update is not None
            or (self.waiting() and self.paused is None)
        ):
            return FlushCacheReqOutput(False, "requests are running or queued; flush when idle")
        self.tree_cache.reset()
        return FlushCacheReqOutput(True, "prefix cache flushed")

    # ------------------------------------------------------------------ weight updates

    def start_weight_update(self, msg: Any) -> None:
        """Queue an update of any kind (``UPDATE_REQUESTS``); it runs once no request holds KV."""
        refused = (
            "a weight update is already in progress"
            if self.pending_update is not None
            else self.refuse_update()
        )
        if refused:
            self.sender.send(self._reply(msg, False, self._drain_refused(msg, refused)))
            return
        self.pending_update = msg
        if msg.abort_all_requests:
            self.abort(None, {"type": "abort", "message": "aborted for a weight update"})
        if isinstance(msg, UpdateWeightsFromDiskReqInput):
            self.publish(phase=WeightsPhase.LOADING)
            self.watchdog.end()  # building the candidate model may outlast one step's watchdog
            self.staging = start_staging(self.worker, msg)
            logger.info(
                "[tp %d] weight update to %s queued: staging while the admitted requests finish",
                self.tp_rank,
                msg.revision,
            )

    def admits(self) -> Callable[[Req], bool] | None:
        """None while no update is pending; else which waiting requests may still start: the
        ones retracted after they began on the old weights, and for a disk update the ones the
        HTTP process admitted before it (``arrived_before``)."""
        msg = self.pending_update
        return None if msg is None else update_admits(msg)

    def abort_weight_update(self, _msg: AbortWeightUpdateReqInput) -> None:
        """Stop a pending disk update (every rank got this message in the same step, so every
        rank votes no): its reply says ``aborted``. One that already ran has answered, so there
        is nothing to do."""
        if not isinstance(self.pending_update, UpdateWeightsFromDiskReqInput):
            return
        self.run_pending_update(aborted=True)

    def refuse_update(self) -> str | None:
        """Why an update cannot be queued now, or None."""
        if self.paused is PauseMode.IN_PLACE and self.holds_kv():
            return (
                "generation is paused in_place with requests holding KV computed by the old weights; "
                "pause with mode 'retract' or 'abort' before updating weights"
            )
        if "weights" in self.memory_saver.released:
            return "weights are released; POST /resume_memory_occupation with tag 'weights' first"
        return None

    def _drain_refused(self, msg: Any, refused: str) -> str:
        """The reply message for a refused update. A refused trainer update still receives (and
        discards) the broadcast the trainer sends anyway, so the trainer is not left blocked
        until its timeout (except while another update owns the group's broadcasts)."""
        if (
            not isinstance(msg, UpdateWeightsFromDistributedReqInput)
            or self.pending_update is not None
        ):
            return refused
        self.watchdog.end()  # receiving may outlast one step's watchdog
        return self.worker.update_weights_from_distributed(msg, refused=refused)[1]

    def maybe_run_weight_update(self) -> None:
        """Once no request runs and none that :meth:`admits` waits (a disk update's staging
        goes on meanwhile), run the pending update (:meth:`run_pending_update`)."""
        if self.pending_update is None or awaiting_cutoff(self.pending_update):
            return
        admits = self.admits()
        assert admits is not None
        started = not self.generation_blocked() and any(admits(r) for r in self.waiting())
        if self.holds_kv() or started:
            # Retracted requests that began on the old weights finish on them too; paused with
            # ``retract`` (an RL loop's pause -> update -> continue) they resume on the new ones.
            return
        self.run_pending_update()

    def run_pending_update(self, aborted: bool = False) -> None:
        """Commit (or, ``aborted``, drop) the pending update: wait for its staging, load, flush
        the prefix cache, publish the new :class:`WeightsState`, reply."""
        msg, self.pending_update = self.pending_update, None
        staging, self.staging = self.staging, None
        self.watchdog.end()  # loading a checkpoint may take longer than one step's watchdog
        logger.info(
            "[tp %d] weight update: no admitted request left; %s",
            self.tp_rank,
            "aborting" if aborted else "committing once staged",
        )
        if staging is not None and aborted:
            staging.cancel()
        staged = None if staging is None else staging.result(self.abort_requested)
        outcome = run_weight_update(
            self.worker,
            msg,
            self.weights,
            on_phase=lambda phase: self.publish(phase=phase),
            with_digest=self.sender.enabled,
            abort_requested=(lambda: True) if aborted else self.abort_requested,
            staged=staged,
        )
        if outcome.ok:
            self.memory_saver.note_loaded(outcome.names)
        # Old KV must never serve new weights (a trainer's buckets pass flush_cache false but
        # the last). A failed or aborted update changed no rank's weights: the cache stays (an
        # abort may come while requests hold cached KV). ``ok`` is the vote every rank shares;
        # ``aborted`` is known only where the abort was seen, and TP ranks with different
        # prefix caches would build different EXTEND batches.
        if msg.flush_cache and outcome.ok:
            self.tree_cache.reset()
        self.publish(**outcome.changes)
        logger.info(
            "[tp %d] %s: %s %s (weight_version %s)",
            self.tp_rank,
            type(msg).__name__,
            outcome.ok,
            outcome.message,
            self.weights.weight_version,
        )
        reply = self._reply(msg, outcome.ok, outcome.message, outcome.timings, outcome.aborted)
        self.sender.send(reply)
        self.send_serving_state()

    @staticmethod
    def _reply(
        msg: Any,
        ok: bool,
        message: str,
        timings: UpdateTimings | None = None,
        aborted: bool = False,
    ) -> Any:
        """The reply to an update; a disk update's carries its phase times (None: refused
        before it ran) and whether an abort stopped it."""
        if not isinstance(msg, UpdateWeightsFromDiskReqInput):
            return ControlReqOutput(ok, message)
        return UpdateWeightsFromDiskReqOutput(
            ok,
            message,
            None if timings is None else timings.load_seconds,
            None if timings is None else timings.recapture_seconds,
            aborted,
        )

    # ------------------------------------------------------------------ controls

    def get_weights_by_name(self, msg: GetWeightsByNameReqInput) -> tuple:
        if "weights" in self.memory_saver.released:
            return False, "weights are released; POST /resume_memory_occupation first"
        try:
            return (
                True,
                f"first {msg.truncate_size} rows of {msg.name}",
                self.worker.get_weights_by_name(msg.name, msg.truncate_size),
            )
        except WeightUpdateError as exc:
            return False, str(exc)

    def pause_generation(self, msg: PauseGenerationReqInput) -> tuple[bool, str]:
        try:
            mode = PauseMode(msg.mode)
        except ValueError:
            return False, f"mode must be one of {[m.value for m in PauseMode]}, got {msg.mode!r}"
        if mode is PauseMode.ABORT:
            self.abort(None, {"type": "abort", "message": "aborted by /pause_generation"})
        elif mode is PauseMode.RETRACT:
            self.retract()
        self.paused = mode
        return True, f"generation paused ({mode.value})"

    def continue_generation(self, _msg: ContinueGenerationReqInput) -> tuple[bool, str]:
        was, self.paused = self.paused, None
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
