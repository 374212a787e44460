"""The LoRA-adapter and MoE-expert control messages of :mod:`shardline_runtime.managers.io_struct`
(which re-exports them; the direction of each is listed there)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoadLoRAAdapterReqInput:
    lora_name: str
    lora_path: str


@dataclass
class UnloadLoRAAdapterReqInput:
    lora_name: str


@dataclass
class LoRAAdapterReqOutput:
    """``status_code``: 200, 400 (bad adapter or name) or 503 (pool full of adapters in use).
    ``loaded``: ``{name: path}`` after the operation."""

    success: bool
    message: str
    status_code: int = 200
    param: str | None = None
    loaded: dict[str, str] = field(default_factory=dict)


@dataclass
class ExpertDistributionReqInput:
    """Expert-distribution recorder control: ``action`` is ``start`` (with ``mode``), ``stop``
    or ``dump`` (``to_file``: write into ``--expert-distribution-recorder-dir``)."""

    action: str
    mode: str | None = None
    to_file: bool = False


@dataclass
class ExpertDistributionReqOutput:
    success: bool
    message: str = ""
    record: dict[str, Any] | None = None


@dataclass
class RebalanceExpertsReqInput:
    """Re-place the experts (EPLB) from the recorded load, on every rank."""


@dataclass
class RebalanceExpertsReqOutput:
    """Imbalance is max / mean tokens per expert-parallel rank (1.0 = balanced)."""

    success: bool
    message: str
    imbalance_before: float | None = None
    imbalance_after_expected: float | None = None
    moved_experts: int = 0
