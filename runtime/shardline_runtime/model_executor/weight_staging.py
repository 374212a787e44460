"""Staging a weight update from disk: the new weights checked and loaded on the CPU, beside the
live ones, until the ranks' vote commits them (``weight_update.py``).

Staging has two halves. :meth:`WeightStager.prepare` checks the checkpoint's headers and config
and builds each candidate model (the target's, then a speculative draft's); building sets the
process-wide default dtype, so it runs on the scheduler's thread. :meth:`WeightStager.load`
reads every tensor, compares each candidate with its live model and reads the fp8 KV scales; it
touches no live weight, so :class:`BackgroundStaging` runs it on a thread of its own while the
scheduler serves the requests that arrived before the update (the pause then covers only the
commit and the recapture). ``cancelled`` is polled before each tensor and once at the end; True
stops the staging as an abort (:class:`WeightUpdateAborted`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardline_runtime.model_executor.kv_cache_dtype import checkpoint_kv_scales

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors")


class WeightUpdateError(ValueError):
    """The new checkpoint cannot replace the live weights (the message says why)."""


class WeightUpdateAborted(Exception):
    """The update was aborted before it committed (``POST /abort_weight_update``)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def prepare_candidate(model_runner: Any, model_path: str, load_format: str = "auto"):
    """Check and parse the new checkpoint for this rank and build its model on the CPU, not yet
    loaded and without touching live weights (:func:`load_into` reads its tensors).

    Returns:
        ``(new_model_config, new_model, tensors)``.

    Raises:
        WeightUpdateError: bad ``load_format``, or the architecture differs.
        CheckpointError / ModelConfigError / OSError: from the validator, parser and loader.
    """
    from shardline_runtime.configs.model_config import ModelConfig
    from shardline_runtime.layers.quantization.online_fp8 import requested_by
    from shardline_runtime.model_loader.loader import build_for_load
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

    model, tensors = build_for_load(
        new_config,
        model_path,
        torch.device("cpu"),
        prepare=same_expert_placement,
        stage=model_runner.pipeline_stage,
    )
    return new_config, model, tensors


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


@dataclass
class StagedWeights:
    """One disk update's staged weights.

    Attributes:
        model_path: the target's new checkpoint.
        entries: ``(runner, new_config, new_model, kv_scales)`` per update (target, then draft),
            complete only when ``reason`` is empty.
        reason: why staging failed or stopped ("" when every update staged).
        aborted: staging was stopped by ``cancelled`` (not a failure: the old weights simply stay).
        seconds: wall-clock seconds staging took (``time.monotonic``), prepare to the end of load.
    """

    model_path: str
    entries: list[tuple[Any, Any, Any, dict]] = field(default_factory=list)
    reason: str = ""
    aborted: bool = False
    seconds: float = 0.0

    def abort(self) -> None:
        """Count it as aborted whatever its staging reached (an abort every rank received)."""
        self.entries.clear()
        self.aborted = True
        self.reason = f"update_weights_from_disk({self.model_path}) aborted before it committed"


class WeightStager:
    """Stages the new weights of ``model_runner`` (and of a ``draft``: ``(runner, path)``) from
    ``model_path``; :meth:`prepare`, then :meth:`load` (see the module docstring)."""

    def __init__(
        self,
        model_runner: Any,
        model_path: str,
        load_format: str = "auto",
        draft: tuple[Any, str] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        self.staged = StagedWeights(model_path)
        self._updates = [(model_runner, model_path)] + ([draft] if draft is not None else [])
        self._load_format = load_format
        self._cancelled = cancelled or (lambda: False)
        self._candidates: list[tuple[Any, str, Any, Any, dict]] = []
        self._tp_rank = model_runner.tp_rank
        self._began = time.monotonic()
        # the scheduler runs under inference mode; tensors built there are written there too
        self._inference_mode = torch.is_inference_mode_enabled()

    def _check_cancelled(self) -> None:
        if self._cancelled():
            raise WeightUpdateAborted("aborted before it committed")

    def prepare(self) -> None:
        """Check and build every candidate (the scheduler's thread); a failure is kept in
        ``staged.reason`` for :meth:`load` to return."""
        try:
            for runner, path in self._updates:
                built = prepare_candidate(runner, path, self._load_format)
                self._candidates.append((runner, path, *built))
        except Exception as exc:  # any failure here must leave the live weights alone
            self._failed(exc, len(self._candidates))

    def load(self) -> StagedWeights:
        """Read, compare and finish staging (any thread); the result, its ``seconds`` set."""
        try:
            if not self.staged.reason:
                with torch.inference_mode(self._inference_mode):
                    self._load_each()
                self._check_cancelled()  # the last moment an abort stops the update
        except WeightUpdateAborted:
            self.staged.aborted = True
            self.staged.reason = (
                f"update_weights_from_disk({self.staged.model_path}) aborted before it committed"
            )
            logger.info("[tp %d] %s", self._tp_rank, self.staged.reason)
        except Exception as exc:  # any failure here must leave the live weights alone
            self._failed(exc, len(self.staged.entries))
        self._candidates.clear()
        if self.staged.reason:
            self.staged.entries.clear()
        self.staged.seconds = time.monotonic() - self._began
        return self.staged

    def _load_each(self) -> None:
        from shardline_runtime.model_loader.loader import load_into

        for runner, path, new_config, new_model, tensors in self._candidates:
            load_into(new_model, tensors, self._check_cancelled)
            compare_models(runner.model_config, runner.model, new_config, new_model)
            # the fp8 KV scales belong to the checkpoint: read (and check) them with it
            scales = checkpoint_kv_scales(path, runner.kv_cache_dtype)
            self.staged.entries.append((runner, new_config, new_model, scales))

    def _failed(self, exc: Exception, done: int) -> None:
        # the target staged, the draft did not: name the draft's checkpoint
        draft = self._updates[1][1] if len(self._updates) > 1 and done == 1 else None
        which = f"draft model {draft}: " if draft is not None else ""
        self.staged.reason = f"{which}{type(exc).__name__}: {exc}"
        logger.warning(
            "[tp %d] new checkpoint %s rejected: %s",
            self._tp_rank,
            self.staged.model_path,
            self.staged.reason,
        )


def stage_weights(
    model_runner: Any,
    model_path: str,
    load_format: str = "auto",
    draft: tuple[Any, str] | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> StagedWeights:
    """Stage on the calling thread (both halves of :class:`WeightStager`)."""
    stager = WeightStager(model_runner, model_path, load_format, draft, cancelled)
    stager.prepare()
    return stager.load()


class BackgroundStaging:
    """Stages on a thread of its own while the scheduler serves: :meth:`WeightStager.prepare`
    runs in the constructor (the caller's thread), :meth:`WeightStager.load` on the thread."""

    def __init__(
        self,
        model_runner: Any,
        model_path: str,
        load_format: str = "auto",
        draft: tuple[Any, str] | None = None,
    ) -> None:
        self._cancel = threading.Event()
        self._stager = WeightStager(
            model_runner, model_path, load_format, draft, cancelled=self._cancel.is_set
        )
        self._stager.prepare()
        self._result: StagedWeights | None = None
        self._thread = threading.Thread(target=self._run, name="weight-staging", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._result = self._stager.load()

    def cancel(self) -> None:
        """Stop at the next tensor; the result says ``aborted``."""
        self._cancel.set()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, abort_requested: Callable[[], bool] = lambda: False) -> StagedWeights:
        """Wait for the staging to end, polling ``abort_requested`` every 50 ms meanwhile and
        once more at the end (the last moment before the vote); an abort seen, or a
        :meth:`cancel` before, makes the result ``aborted`` whatever the staging reached."""
        while self._thread.is_alive():
            if abort_requested():
                self.cancel()
            self._thread.join(0.05)
        if abort_requested():
            self.cancel()
        assert self._result is not None  # the thread always sets it
        if self._cancel.is_set():
            self._result.abort()
        return self._result
