"""ServerState: what the HTTP process knows about the schedulers, one copy of each fact.

- ``weights``: the one :class:`WeightsState` copy, replaced whole by each ``WeightsState`` the
  rank-0 scheduler sends (its control plane owns the live record; R3 of the redesign);
- ``stats``: the last :class:`SchedulerStats` (load and KV usage);
- ``lora_adapters``: the loaded LoRA adapters, ``name -> path``, as the schedulers reported;
- ``info``: the limits the schedulers reported at start (:class:`SchedulerInfo`).
"""

from __future__ import annotations

from typing import Any

from shardline_runtime.managers.io_struct import SchedulerInfo, SchedulerStats
from shardline_runtime.weights_state import WeightsPhase, WeightsState


class ServerState:
    """Server-wide facts for the HTTP routes (see the module docstring).

    Args:
        info: the rank-0 scheduler's :class:`SchedulerInfo` (limits, served weights, digest).
        lora_adapters: adapters loaded at start, ``name -> path``.
    """

    def __init__(self, info: SchedulerInfo, lora_adapters: dict[str, str] | None = None):
        self.info = info
        self.weights: WeightsState = info.weights
        self.stats = SchedulerStats(0, 0, 0, 0, info.max_total_num_tokens)
        self.lora_adapters: dict[str, str] = dict(lora_adapters or {})

    def set_weights(self, state: WeightsState) -> None:
        """Replace the weights record whole (a message from the schedulers)."""
        self.weights = state

    def mark_updating(self) -> None:
        """An update was sent: report ``loading`` until the schedulers' own record arrives."""
        self.weights = self.weights.model_copy(update={"phase": WeightsPhase.LOADING})

    def end_update_if_silent(self) -> None:
        """The update call returned but no record ended its phase (lost): back to serving."""
        if self.weights.phase.updating:
            self.weights = self.weights.model_copy(update={"phase": WeightsPhase.SERVING})

    def weights_info(self) -> dict[str, Any]:
        """The ``weights`` block of ``/get_server_info`` plus the flat keys existing clients
        read (``weights_phase``, ``weights_revision``, ``weights_digest``,
        ``weights_source_revision``, ``weight_version``,
        ``last_weight_update``, ``model_path``, ``quantization``) and ``cuda_graphs`` (what the
        runner really captured: ``{decode_batch_sizes, piecewise_token_buckets, reason}``), all
        from the one record."""
        w = self.weights
        return {
            "weights": w.model_dump(mode="json"),
            "weights_phase": w.phase.value,
            "weights_revision": w.revision,
            "model_path": w.model_path,
            "weights_digest": w.digest,
            "weights_source_revision": w.source_revision,
            "last_weight_update": (
                None if w.last_update is None else w.last_update.model_dump(mode="json")
            ),
            "weight_version": w.weight_version,
            "quantization": w.quantization,
            "cuda_graphs": None if w.graphs is None else w.graphs.model_dump(mode="json"),
        }

    def lora_for_model(self, model: str | None) -> str | None:
        """The LoRA adapter an OpenAI ``model`` names (None: the base model)."""
        return model if model is not None and model in self.lora_adapters else None
