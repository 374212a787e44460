"""In-place weight update from disk (DESIGN 2.4), for one TP rank of a running ModelRunner.

Steps, each rank:
  1. ``loading``: first the cheap header-only check (``model_loader.validate.validate_checkpoint``:
     config, every tensor name and full checkpoint shape, shard files present and complete),
     which fails fast without reading tensor data; then build a complete copy of this rank's shard of
     the new model on the CPU through the normal loader (which checks every shard file is there
     and every parameter is written exactly once); compare it with the live model: same
     architecture, same parameter names and shapes (the first mismatch is reported with old
     and new shapes), same dtype, and the same non-weight config (RoPE, norms, heads...), since
     only weights are replaced. Live weights are not touched.
  2. All ranks agree: ``all_reduce_min`` of a success flag. Any failure on any rank -> every
     rank keeps its old weights and returns ``(False, message)``. This vote is the commit point:
     an abort (``POST /abort_weight_update``, seen through ``cancelled``) before it makes that
     rank vote no, so the update stops while the new weights are only staged on the CPU;
     after it the update runs to its end.
  3. Copy each new tensor into the existing parameter storage (``param.data.copy_``), so every
     ``data_ptr`` stays the same and captured CUDA graphs read the new weights; set the fp8 KV
     scales to the new checkpoint's (1.0 where it has none; read and checked in step 1).
  4. ``recapturing`` (when asked and graphs exist): capture the decode and piecewise graphs again.
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
from shardline_runtime.model_executor.kv_cache_dtype import checkpoint_kv_scales, set_kv_scales
from shardline_runtime.weights_state import WeightsPhase

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors")


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


class WeightUpdateError(ValueError):
    """The new checkpoint cannot replace the live weights (the message says why)."""


class WeightUpdateAborted(Exception):
    """The update was aborted before it committed (``POST /abort_weight_update``)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load_candidate(
    model_runner: Any,
    model_path: str,
    load_format: str = "auto",
    before_tensor: Callable[[], None] | None = None,
):
    """Parse and load the new checkpoint for this rank on the CPU, without touching live weights
    (``before_tensor()`` runs before each tensor is loaded; what it raises stops the load).

    Returns:
        ``(new_model_config, new_model)``.

    Raises:
        WeightUpdateError: bad ``load_format``, or the architecture differs.
        CheckpointError / ModelConfigError / OSError: from the validator, parser and loader.
    """
    from shardline_runtime.configs.model_config import ModelConfig
    from shardline_runtime.layers.quantization.online_fp8 import requested_by
    from shardline_runtime.model_loader.loader import load_model
    from shardline_runtime.model_loader.validate import validate_checkpoint

    if load_format not in LOAD_FORMATS:
        raise WeightUpdateError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    live = model_runner.model_config
    validate_checkpoint(model_path, live)
    new_config = ModelConfig.from_pretrained(
        model_path,
        dtype=_dtype_name(live.dtype),
        context_length=model_runner.args.model.context_length,
        device_type=torch.device(model_runner.device).type,
        quantization=requested_by(live.quantization),
    )
    if new_config.architecture != live.architecture:
        raise WeightUpdateError(
            f"config field architectures: old {live.architecture!r}, new {new_config.architecture!r}"
        )
    new_config.check_tp_size(model_runner.tp_size)
    from shardline_runtime.layers.moe.expert_location import copy_expert_placement

    def same_expert_placement(candidate: torch.nn.Module) -> None:
        copy_expert_placement(model_runner.model, candidate)

    return new_config, load_model(
        new_config,
        model_path,
        torch.device("cpu"),
        prepare=same_expert_placement,
        stage=model_runner.pipeline_stage,
        before_tensor=before_tensor,
    )


def compare_models(
    live_config: Any, live_model: torch.nn.Module, new_config: Any, new_model: torch.nn.Module
) -> None:
    """Check that ``new_model`` can be copied into ``live_model`` parameter by parameter.

    Raises:
        WeightUpdateError: naming the first mismatching parameter (with old and new shapes or
            dtypes), a missing or unexpected parameter, or a differing config field.
    """
    new_params = dict(new_model.named_parameters())
    live_params = dict(live_model.named_parameters())
    for name, old in live_params.items():
        new = new_params.get(name)
        if new is None:
            raise WeightUpdateError(
                f"parameter {name} (old shape {tuple(old.shape)}) is missing from the new checkpoint"
            )
        if new.shape != old.shape:
            raise WeightUpdateError(
                f"parameter {name}: old shape {tuple(old.shape)}, new shape {tuple(new.shape)}"
            )
        if new.dtype != old.dtype:
            raise WeightUpdateError(
                f"parameter {name}: old dtype {old.dtype}, new dtype {new.dtype}"
            )
    for name, new in new_params.items():
        if name not in live_params:
            raise WeightUpdateError(
                f"unexpected parameter {name} (new shape {tuple(new.shape)}) not in the serving model"
            )
    from shardline_runtime.configs.model_config import first_mismatch

    mismatch = first_mismatch(live_config, new_config)
    if mismatch is not None:
        field_name, old_value, new_value = mismatch
        raise WeightUpdateError(f"config field {field_name}: old {old_value!r}, new {new_value!r}")


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

    Returns:
        ``(True, message)`` after the new weights are live, or ``(False, reason)`` with the
        old weights untouched on every rank.
    """
    phase = on_phase or (lambda _phase: None)
    phase(WeightsPhase.LOADING)
    reason = ""
    staged: list[tuple[Any, Any, Any, dict[int, dict[str, float]]]] = []
    updates = [(model_runner, model_path)] + ([draft] if draft is not None else [])
    is_cancelled = cancelled or (lambda: False)
    aborted = False

    def check_cancelled() -> None:
        if is_cancelled():
            raise WeightUpdateAborted("aborted before it committed")

    try:
        for runner, path in updates:
            new_config, new_model = load_candidate(runner, path, load_format, check_cancelled)
            compare_models(runner.model_config, runner.model, new_config, new_model)
            # the fp8 KV scales belong to the checkpoint: read (and check) them with its weights
            kv_scales = checkpoint_kv_scales(path, runner.kv_cache_dtype)
            staged.append((runner, new_config, new_model, kv_scales))
        check_cancelled()  # the last moment an abort can stop the update: the vote commits it
    except WeightUpdateAborted:
        aborted = True
        reason = f"update_weights_from_disk({model_path}) aborted before it committed"
        logger.info("[tp %d] %s", model_runner.tp_rank, reason)
    except Exception as exc:  # any failure here must leave the live weights alone
        # the target staged, the draft did not: name the draft's checkpoint
        which = f"draft model {draft[1]}: " if draft is not None and len(staged) == 1 else ""
        reason = f"{which}{type(exc).__name__}: {exc}"
        logger.warning(
            "[tp %d] new checkpoint %s rejected: %s", model_runner.tp_rank, model_path, reason
        )
    all_ok = all_reduce_min_int(0 if reason else 1) == 1
    if not all_ok and aborted:  # nothing failed: the old weights simply stay
        phase(WeightsPhase.SERVING)
        return False, f"{reason}; old weights kept"
    if not all_ok:
        phase(WeightsPhase.FAILED)
        if not reason:
            reason = "the new checkpoint was rejected on another tensor-parallel rank or pipeline stage (see its log)"
        return False, f"update_weights_from_disk({model_path}) failed; old weights kept. {reason}"
    assert len(staged) == len(updates)  # every rank staged every update (all_ok)
    copied = 0
    for runner, new_config, new_model, kv_scales in staged:
        copied += copy_weights_in_place(runner.model, new_model)
        set_kv_scales(runner.model, kv_scales, runner.kv_cache_dtype)
        runner.model_config = new_config  # same shapes and behaviour; reports the new path
    staged.clear()
    graphs = model_runner.graphs
    if recapture_cuda_graph and graphs.present:
        phase(WeightsPhase.RECAPTURING)
        graphs.capture()  # decode graphs, then the EXTEND pieces
    phase(WeightsPhase.SERVING)
    return (
        True,
        f"loaded {model_path} in place ({copied / 2**20:.1f} MiB on tp rank {model_runner.tp_rank})",
    )
