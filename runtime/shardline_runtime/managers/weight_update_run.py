"""Run one queued weight update on this rank and say how the :class:`WeightsState` changes.

The control plane (``control_plane.py``) decides *when* an update runs; this module runs it:
the load (disk, tensor or distributed), then the new device-graph settings an update may carry,
and returns the outcome with the fields of the new :class:`WeightsState`. The checkpoint digest is
computed here, where the weights were loaded (headers and three samples per file; see
``model_loader/checkpoint_digest.py``), while no step runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardline_runtime.managers.io_struct import (
    UpdateWeightsFromDiskReqInput,
    UpdateWeightsFromTensorReqInput,
)
from shardline_runtime.model_executor.weight_staging import BackgroundStaging, StagedWeights
from shardline_runtime.model_executor.weight_update import PhaseClock
from shardline_runtime.model_loader.checkpoint_digest import checkpoint_digest
from shardline_runtime.model_loader.revision_cache import source_revision
from shardline_runtime.weights_state import (
    CapturedGraphs,
    UpdateTimings,
    WeightsPhase,
    WeightsState,
)

logger = logging.getLogger(__name__)


def safe_checkpoint_digest(model_path: str) -> str | None:
    """:func:`checkpoint_digest`, or None (logged) when the files cannot be read from here."""
    try:
        return checkpoint_digest(model_path)
    except (OSError, ValueError) as exc:
        logger.warning("no weights digest for %s: %s", model_path, exc)
        return None


def initial_weights_state(
    model_path: str,
    revision: str | None,
    weight_version: str,
    with_digest: bool,
    model_source: str | None = None,
    graphs: CapturedGraphs | None = None,
    quantization: str = "unquantized",
    draft: tuple[str, str | None] | None = None,
) -> WeightsState:
    """The :class:`WeightsState` of the weights loaded at start (``phase`` serving), with the
    runner's report of the graphs it captured, serving the ``quantization`` scheme. The digest is
    computed only ``with_digest`` (rank 0, which reports it); ``model_source`` (the hf:// or
    s3:// reference the directory was fetched from) is reported as ``model_path`` when given.
    ``draft``: ``(directory, source reference or None)`` of the draft model or EAGLE head."""
    state = WeightsState(
        model_path=model_source or model_path,
        revision=revision,
        weight_version=weight_version,
        digest=safe_checkpoint_digest(model_path) if with_digest else None,
        source_revision=source_revision(model_path),
        quantization=quantization,
        graphs=graphs,
    )
    if draft is None:
        return state
    return state.model_copy(update=draft_fields(draft[0], draft[1], with_digest))


def draft_fields(path: str, source: str | None, with_digest: bool) -> dict[str, Any]:
    """The draft's fields of a :class:`WeightsState` for the checkpoint in ``path`` (reported
    as ``source``, its hf:// / s3:// reference, when given)."""
    return {
        "draft_model_path": source or path,
        "draft_digest": safe_checkpoint_digest(path) if with_digest else None,
        "draft_source_revision": source_revision(path),
    }


@dataclass
class UpdateOutcome:
    """What one update did.

    Attributes:
        ok / message: the update's result.
        names: checkpoint names of the tensors a trainer's update wrote (None: a disk update,
            which writes every tensor).
        changes: the fields of the new :class:`WeightsState`.
        timings: a disk update's phase times (None for a trainer's update).
        aborted: a disk update stopped by an abort before it committed (the old weights serve).
    """

    ok: bool
    message: str
    names: list[str] | None = None
    changes: dict[str, Any] = field(default_factory=dict)
    timings: UpdateTimings | None = None
    aborted: bool = False


class AbortLatch:
    """Remembers whether ``requested()`` ever answered True (an abort is taken off the input
    once, so the answer must be kept)."""

    def __init__(self, requested: Callable[[], bool]) -> None:
        self._requested = requested
        self.seen = False

    def __call__(self) -> bool:
        self.seen = self.seen or self._requested()
        return self.seen


def arrived_before(req: Any, requested_at: float | None) -> bool:
    """Whether the HTTP process admitted ``req`` (a ``Req``) before an update requested at
    ``requested_at`` (both its ``time.monotonic``; None on either side: no)."""
    admitted_at = req.admitted_at
    return requested_at is not None and admitted_at is not None and admitted_at < requested_at


def awaiting_cutoff(msg: Any) -> bool:
    """Whether ``msg`` (a pending update, or None) is a disk update whose admission window
    (``admit_seconds``) has not yet ended: its ``WeightUpdateCutoffReqInput`` has not come."""
    return (
        isinstance(msg, UpdateWeightsFromDiskReqInput)
        and msg.admit_seconds > 0
        and msg.requested_at is None
    )


def update_admits(msg: Any) -> Callable[[Any], bool]:
    """Which waiting requests (``Req``) may still start while the update ``msg`` is pending:
    the ones retracted after they began on the old weights, and for a disk update the ones the
    HTTP process admitted before it (``arrived_before``): every one while its admission window
    is open (:func:`awaiting_cutoff`: the HTTP process still admits them)."""
    if awaiting_cutoff(msg):
        return lambda req: True
    cutoff = getattr(msg, "requested_at", None)
    return lambda req: bool(req.output_ids) or arrived_before(req, cutoff)


def cut_off(msg: Any, requested_at: float) -> None:
    """A ``WeightUpdateCutoffReqInput``: the admission window of the pending update ``msg``
    ended at ``requested_at`` (the HTTP process's ``time.monotonic``); from now on it waits
    only for the requests admitted before that. Nothing for no pending update or one that is
    not awaiting its cutoff (an update that ended first, then a new one)."""
    if awaiting_cutoff(msg):
        msg.requested_at = requested_at


def start_staging(worker: Any, msg: UpdateWeightsFromDiskReqInput) -> BackgroundStaging | None:
    """Begin staging the disk update ``msg``'s weights on a thread while the scheduler serves;
    None when the update will be refused anyway (a draft path without a draft model)."""
    from shardline_runtime.speculative.draft_worker import draft_update

    draft, refused = draft_update(getattr(worker, "draft_worker", None), msg.draft_model_path)
    if refused:
        return None
    return BackgroundStaging(worker.model_runner, msg.model_path, msg.load_format or "auto", draft)


def run_weight_update(
    worker: Any,
    msg: Any,
    current: WeightsState,
    on_phase: Callable[[WeightsPhase], None],
    with_digest: bool,
    abort_requested: Callable[[], bool] = lambda: False,
    staged: StagedWeights | None = None,
) -> UpdateOutcome:
    """Run the update ``msg`` (one of ``UPDATE_REQUESTS``) on ``worker``, every rank together.

    ``on_phase`` hears each update phase as it begins (``loading``, then ``recapturing`` when
    graphs are captured again); the phase in ``outcome.changes`` is the one that holds afterwards:
    a disk update's last (``serving`` or ``failed``; ``serving`` after an abort), ``serving``
    after a trainer's update that succeeded, else the phase before. ``abort_requested`` is
    polled while a disk update stages its weights (rank 0 reads its input for an
    ``AbortWeightUpdateReqInput``); ``staged``: a disk update's weights, already staged while
    the scheduler served (their staging seconds count as loading).
    """
    on_phase(WeightsPhase.LOADING)
    if isinstance(msg, UpdateWeightsFromDiskReqInput):
        latch = AbortLatch(abort_requested)
        outcome = _from_disk(worker, msg, on_phase, with_digest, latch, staged)
    else:
        if isinstance(msg, UpdateWeightsFromTensorReqInput):
            ok, message, names = worker.update_weights_from_tensor(msg.serialized_named_tensors)
        else:
            ok, message, names = worker.update_weights_from_distributed(msg)
        phase = WeightsPhase.SERVING if ok else current.phase
        outcome = UpdateOutcome(ok, message, names, {"phase": phase})
    if outcome.ok and msg.weight_version is not None:
        outcome.changes["weight_version"] = msg.weight_version
    return outcome


def _from_disk(
    worker: Any,
    msg: UpdateWeightsFromDiskReqInput,
    on_phase: Callable[[WeightsPhase], None],
    with_digest: bool,
    abort: AbortLatch,
    staged: StagedWeights | None,
) -> UpdateOutcome:
    reported: list[WeightsPhase] = [WeightsPhase.LOADING]

    def runner_phase(phase: WeightsPhase) -> None:
        reported.append(phase)
        if reported[-1].updating:  # the end (serving or failed) comes with the new record
            on_phase(reported[-1])

    clock = PhaseClock(runner_phase)
    ok, message = worker.update_weights_from_disk(
        msg.model_path,
        msg.load_format or "auto",
        recapture_cuda_graph=msg.recapture_cuda_graph,
        on_phase=clock,
        cancelled=abort,
        draft_model_path=msg.draft_model_path,
        staged=staged,
    )
    seconds = clock.seconds()
    if staged is not None:  # staged while serving: that was loading too
        seconds["load_seconds"] += staged.seconds
    settled = reported[-1]
    if ok and (msg.cuda_graph_max_bs is not None or msg.disable_cuda_graph is not None):
        started = time.monotonic()
        worker.update_cuda_graph_settings(
            msg.cuda_graph_max_bs, bool(msg.disable_cuda_graph), on_phase=runner_phase
        )
        # capturing with the new settings is recapture time too
        seconds["recapture_seconds"] += time.monotonic() - started
    reported_path = msg.model_source or msg.model_path
    timings = UpdateTimings(success=ok, model_path=reported_path, **seconds)
    changes: dict[str, Any] = {
        "phase": settled,
        "last_update": timings,
        "graphs": worker.captured_graphs(),  # what the update's recapture really captured
    }
    if ok:
        changes["model_path"] = reported_path
        changes["revision"] = msg.revision
        changes["digest"] = safe_checkpoint_digest(msg.model_path) if with_digest else None
        changes["source_revision"] = source_revision(msg.model_path)
        if msg.draft_model_path is not None:  # committed with the target's, so reported with it
            changes.update(draft_fields(msg.draft_model_path, msg.draft_model_source, with_digest))
    aborted = not ok and (abort.seen or (staged is not None and staged.aborted))
    return UpdateOutcome(ok, message, None, changes, timings, aborted=aborted)
