"""In-place weight update from disk (DESIGN 2.4), for one TP rank of a running ModelRunner.

Steps, each rank:
  1. ``loading``: first the cheap header-only check (``model_loader.validate.validate_checkpoint``:
     config, every tensor name and full checkpoint shape, shard files present and complete),
     which fails fast without reading tensor data; then build a complete copy of this rank's shard of
     the new model on the CPU through the normal loader (which checks every shard file is there
     and every parameter is written exactly once); compare it with the live model: same
     architecture, same parameter names and shapes (the first mismatch is reported with old
     and new shapes), same dtype, and the same non-weight config (RoPE, norms, heads...), since
     only weights are replaced. Live weights are not touched (``weight_staging.py``; the
     scheduler stages on a thread of its own while it serves, ``BackgroundStaging``).
  2. All ranks agree: ``all_reduce_min`` of a success flag. Any failure on any rank -> every
     rank keeps its old weights and returns ``(False, message)``. This vote is the commit point:
     an abort (``POST /abort_weight_update``, seen through ``cancelled``) before it makes that
     rank vote no, so the update stops while the new weights are only staged on the CPU;
     after it the update runs to its end.
  3. Copy each new tensor into the existing parameter storage (``param.data.copy_``), so every
     ``data_ptr`` stays the same and captured CUDA graphs read the new weights; set the fp8 KV
     scales to the new checkpoint's (1.0 where it has none; read and checked in step 1).
  4. ``recapturing`` (when asked and graphs exist): capture the decode, piecewise and verify
     graphs again, and the draft model's decode graphs when its weights changed too.
  5. ``serving``; a failed update leaves ``failed`` (the old weights keep serving).

With speculative decoding's draft model (``draft``: its runner and new checkpoint), step 1
stages and checks the draft's checkpoint the same way after the target's, the one vote covers
both, and step 3 copies both: a draft that fails to load aborts the target's staged update too.

Peak extra memory is one CPU copy of this rank's weights (and the draft's); device memory does
not grow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from shardline_runtime.distributed import all_reduce_min_int
from shardline_runtime.model_executor.kv_cache_dtype import set_kv_scales
from shardline_runtime.model_executor.weight_staging import StagedWeights, stage_weights
from shardline_runtime.weights_state import WeightsPhase

logger = logging.getLogger(__name__)


class PhaseClock:
    """Times the phases of one weight update from the ``on_phase`` calls it forwards.

    Use an instance as the ``on_phase`` callback of :func:`update_weights_from_disk` (it passes
    each phase on to ``forward``); afterwards :meth:`seconds` gives the wall-clock seconds
    (``time.monotonic``) spent in ``loading`` (validate, load on the CPU, compare, copy in place)
    and in ``recapturing`` (capturing the decode and piecewise CUDA graphs again). A phase that
    never began counts 0.0 s (no graphs: CPU, graphs disabled, or recapture not asked); a phase
    still running counts up to now.
    """

    def __init__(
        self,
        forward: Callable[[WeightsPhase], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._forward, self._clock = forward, clock
        self._marks: list[tuple[WeightsPhase, float]] = []

    def __call__(self, phase: WeightsPhase) -> None:
        self._marks.append((WeightsPhase(phase), self._clock()))
        if self._forward is not None:
            self._forward(phase)

    def seconds(self) -> dict[str, float]:
        """``{"load_seconds": s, "recapture_seconds": s}`` (floats, seconds)."""
        spent = {WeightsPhase.LOADING: 0.0, WeightsPhase.RECAPTURING: 0.0}
        ends = [t for _, t in self._marks[1:]] + [self._clock()]
        for (phase, began), ended in zip(self._marks, ends):
            if phase in spent:
                spent[phase] += ended - began
        return {
            "load_seconds": spent[WeightsPhase.LOADING],
            "recapture_seconds": spent[WeightsPhase.RECAPTURING],
        }


@torch.no_grad()
def copy_weights_in_place(live_model: torch.nn.Module, new_model: torch.nn.Module) -> int:
    """Copy every parameter of ``new_model`` into the same-named parameter's storage.

    Returns:
        Number of bytes copied.
    """
    new_params = dict(new_model.named_parameters())
    copied = 0
    for name, param in live_model.named_parameters():
        param.data.copy_(new_params[name].data, non_blocking=True)
        copied += param.numel() * param.element_size()
    if param.device.type == "cuda":
        torch.cuda.synchronize(param.device)
    return copied


def update_weights_from_disk(
    model_runner: Any,
    model_path: str,
    load_format: str,
    *,
    recapture_cuda_graph: bool,
    on_phase: Callable[[WeightsPhase], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
    draft: tuple[Any, str] | None = None,
    staged: StagedWeights | None = None,
) -> tuple[bool, str]:
    """Replace ``model_runner``'s weights by those in ``model_path``, in place, on every rank.

    Every rank of every pipeline stage must call this together (it runs one collective over the
    whole world, so a checkpoint rejected on any stage leaves every stage's weights untouched).
    The one caller is ``ModelRunner.update_weights_from_disk`` (which holds the defaults).

    Args:
        model_runner: the live ``ModelRunner`` (``model``, ``model_config``, ``args``,
            ``device``, ``tp_size``, ``kv_cache_dtype``, ``graphs``).
        model_path: directory with ``config.json`` and safetensors.
        load_format: ``auto`` or ``safetensors``.
        recapture_cuda_graph: capture the decode graphs again after the copy (when captured).
        on_phase: called with each :class:`WeightsPhase` as the update progresses.
        cancelled: polled before each tensor is staged and once more before the vote; True
            makes this rank vote no (an abort), so every rank keeps its old weights.
        draft: ``(draft_runner, draft_model_path)``: the draft model's update, committed with
            this one or not at all.
        staged: the weights already staged (``weight_staging.BackgroundStaging``, while the
            scheduler served); None stages them here first (``cancelled`` is then polled).

    Returns:
        ``(True, message)`` after the new weights are live, or ``(False, reason)`` with the
        old weights untouched on every rank.
    """
    phase = on_phase or (lambda _phase: None)
    phase(WeightsPhase.LOADING)
    if staged is None:
        staged = stage_weights(model_runner, model_path, load_format, draft, cancelled)
    all_ok = all_reduce_min_int(0 if staged.reason else 1) == 1
    if not all_ok and staged.aborted:  # nothing failed: the old weights simply stay
        phase(WeightsPhase.SERVING)
        return False, f"{staged.reason}; old weights kept"
    if not all_ok:
        phase(WeightsPhase.FAILED)
        reason = staged.reason or (
            "the new checkpoint was rejected on another tensor-parallel rank or pipeline stage "
            "(see its log)"
        )
        return False, f"update_weights_from_disk({model_path}) failed; old weights kept. {reason}"
    updates = 1 + (draft is not None)
    assert len(staged.entries) == updates  # every rank staged every update (all_ok)
    copied = 0
    runners = [entry[0] for entry in staged.entries]  # the target, then the draft
    for runner, new_config, new_model, kv_scales in staged.entries:
        copied += copy_weights_in_place(runner.model, new_model)
        set_kv_scales(runner.model, kv_scales, runner.kv_cache_dtype)
        runner.model_config = new_config  # same shapes and behaviour; reports the new path
    staged.entries.clear()
    held = [r.graphs for r in runners if r.graphs.present]
    if recapture_cuda_graph and held:
        phase(WeightsPhase.RECAPTURING)
        for graphs in held:
            graphs.capture()  # decode graphs, the EXTEND pieces, verify; the draft's
    phase(WeightsPhase.SERVING)
    return (
        True,
        f"loaded {model_path} in place ({copied / 2**20:.1f} MiB on tp rank {model_runner.tp_rank})",
    )
