"""ExpertDistributionRecorder: how many tokens each physical expert received, per layer and
forward pass (after SGLang's ``ExpertDistributionRecorder``, described in the ModelRunner design
notes).

Every ``FusedMoE`` reports its (T, k) physical expert ids through :meth:`record` while
``recording`` is True; the ModelRunner calls :meth:`on_forward_pass_end` after each pass. When
nothing records, ``FusedMoE.forward`` reads one attribute and the ModelRunner one more per pass:
no tensor is touched (see ``bench/moe_recorder.py`` for the measured cost).

Modes (chosen at :meth:`start`):
- ``stat``: counts summed over all passes since the start, (num_layers, num_physical_experts).
- ``per_pass``: one (num_layers, num_physical_experts) count tensor per forward pass.

Inside CUDA graphs: a captured decode step records too. The graph runner captures with
:attr:`capturing` set, so ``FusedMoE`` records whether or not anyone records then; the counts go
to the static ``_pass_counts`` buffer, and :attr:`row_mask` (a static (max_bs,) int64 buffer of
1 for real rows, 0 for padded ones, set by the runner) keeps padded rows out of them. While
nothing records, a replay's counts land in ``_pass_counts`` and are dropped by the next
:meth:`start` (nothing reads them before).

Expert parallelism does not need a gather here: every rank routes every token (the router is
replicated), so each rank's record already covers all physical experts and all ranks agree.
A separate *window* accumulates counts for EPLB's periodic rebalance, independently of what a
user records.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import Any

import torch

RECORDER_MODES = ("stat", "per_pass")


class RecorderError(ValueError):
    """A recorder request is invalid (names the field and the allowed values)."""


class ExpertDistributionRecorder:
    """Counts tokens per (layer, physical expert).

    Args:
        num_layers: model layers (rows; dense layers stay zero).
        num_physical_experts: slots per MoE layer (``num_experts + ep_num_redundant_experts``).
        device: where counts accumulate (int64).
        dump_dir: directory for :meth:`dump` to write into when asked (``--expert-distribution-recorder-dir``).
    """

    def __init__(
        self,
        num_layers: int,
        num_physical_experts: int,
        device: torch.device | str = "cpu",
        dump_dir: str | None = None,
    ):
        self.num_layers, self.num_physical_experts = num_layers, num_physical_experts
        self.dump_dir = dump_dir
        self.recording = False
        self.mode = "stat"
        self.forward_pass_id = 0
        self._user_active = False
        self._pass_counts = torch.zeros(
            num_layers, num_physical_experts, dtype=torch.int64, device=device
        )
        self._ones = torch.ones(1, dtype=torch.int64, device=device)
        self._stat = torch.zeros_like(self._pass_counts)
        self._passes: list[torch.Tensor] = []
        self._num_recorded_passes = 0
        self._window: torch.Tensor | None = None
        self.capturing = False  # a graph runner captures (or runs its static path): record
        self.row_mask: torch.Tensor | None = None  # (rows,) int64 1/0: which rows count

    @property
    def active(self) -> bool:
        """Whether ``FusedMoE`` must call :meth:`record` now (recording, or capturing a graph
        that must record whenever it replays)."""
        return self.recording or self.capturing

    # ---- control ------------------------------------------------------------------------------

    def start(self, mode: str | None = None) -> None:
        """Begin a new record (previous counts are dropped).

        Raises:
            RecorderError: ``mode`` not in ``RECORDER_MODES``.
        """
        mode = mode or self.mode
        if mode not in RECORDER_MODES:
            raise RecorderError(f"mode must be one of {RECORDER_MODES}, got {mode!r}")
        self.mode = mode
        self._stat.zero_()
        self._passes = []
        self._num_recorded_passes = 0
        self._pass_counts.zero_()
        self._user_active = True
        self.recording = True

    def reset_counts(self) -> None:
        """Drop every count (record and EPLB window) but keep recording as before: called after
        the placement changed, when the recorded physical slots stopped meaning their experts."""
        self._stat.zero_()
        self._passes = []
        self._num_recorded_passes = 0
        self._pass_counts.zero_()
        if self._window is not None:
            self._window.zero_()

    def stop(self) -> None:
        """Stop recording; the record stays available to :meth:`dump`."""
        self._user_active = False
        self.recording = self._window is not None

    @property
    def has_window(self) -> bool:
        """Whether an EPLB window accumulates (``--eplb-rebalance-num-iterations`` > 0)."""
        return self._window is not None

    def enable_window(self) -> None:
        """Also accumulate counts for EPLB (``take_window``), whether or not a user records."""
        self._window = torch.zeros_like(self._pass_counts)
        self.recording = True

    def take_window(self) -> torch.Tensor:
        """The EPLB window's counts (num_layers, num_physical) and a fresh window."""
        if self._window is None:
            raise RecorderError("no EPLB window is kept (enable_window was not called)")
        counts = self._window.clone()
        self._window.zero_()
        return counts

    # ---- hot path -----------------------------------------------------------------------------

    def record(self, layer_id: int, physical_ids: torch.Tensor) -> None:
        """Add one token per entry of ``physical_ids`` (T, k) int64 to layer ``layer_id``; with
        a :attr:`row_mask`, only rows whose mask is 1 (no host sync: capturable)."""
        flat = physical_ids.reshape(-1)
        if self.row_mask is None:
            weights = self._ones.expand(flat.numel())
        else:
            rows, k = physical_ids.shape
            weights = self.row_mask[:rows].unsqueeze(1).expand(rows, k).reshape(-1)
        self._pass_counts[layer_id].index_add_(0, flat, weights)

    def on_forward_pass_end(self) -> None:
        """Close one forward pass: fold its counts into the record and the window."""
        if not self.recording:
            return
        if self._user_active:
            self._num_recorded_passes += 1
            if self.mode == "stat":
                self._stat += self._pass_counts
            else:
                self._passes.append(self._pass_counts.clone())
        if self._window is not None:
            self._window += self._pass_counts
        self._pass_counts.zero_()
        self.forward_pass_id += 1

    # ---- output -------------------------------------------------------------------------------

    def physical_counts(self) -> torch.Tensor:
        """The record's counts summed over passes: (num_layers, num_physical) int64 on CPU."""
        if self.mode == "per_pass":
            return (
                torch.stack(self._passes).sum(0).cpu()
                if self._passes
                else torch.zeros_like(self._stat).cpu()
            )
        return self._stat.cpu()

    def pass_counts(self) -> list[torch.Tensor] | None:
        """Per-pass counts, each (num_layers, num_physical) int64 on CPU (``per_pass`` mode), or
        None in ``stat`` mode."""
        return [p.cpu() for p in self._passes] if self.mode == "per_pass" else None

    def to_dict(
        self,
        physical_to_logical: torch.Tensor,
        num_experts: int,
        total: torch.Tensor | None = None,
        passes: list[torch.Tensor] | None = None,
    ) -> dict[str, Any]:
        """The record as JSON-ready lists.

        Args:
            physical_to_logical: (num_layers, num_physical) int64 (current placement; rows of
                dense layers are ignored).
            num_experts: logical experts.
            total, passes: counts to report instead of this recorder's own (every pipeline
                stage's rows gathered: see ``EPLBManager.dump``); ``total`` (num_layers,
                num_physical), ``passes`` one such tensor per pass (``per_pass`` mode).

        Returns:
            ``{"mode", "recording", "num_forward_passes", "physical_to_logical_map",
            "physical_count" (stat: [layer][physical]; per_pass: [pass][layer][physical]),
            "logical_count" ([layer][logical], summed over passes)}``.
        """
        if total is None:
            total, passes = self.physical_counts(), self.pass_counts()
        logical = torch.zeros(self.num_layers, num_experts, dtype=torch.int64)
        logical.scatter_add_(1, physical_to_logical.cpu(), total)
        return {
            "mode": self.mode,
            "recording": self._user_active,
            "num_forward_passes": self._num_recorded_passes,
            "physical_to_logical_map": physical_to_logical.tolist(),
            "physical_count": [p.tolist() for p in passes]
            if passes is not None
            else total.tolist(),
            "logical_count": logical.tolist(),
        }

    def dump(
        self,
        physical_to_logical: torch.Tensor,
        num_experts: int,
        to_file: bool = False,
        total: torch.Tensor | None = None,
        passes: list[torch.Tensor] | None = None,
    ) -> dict[str, Any]:
        """:meth:`to_dict`, or (``to_file``) write it as JSON into ``dump_dir`` and return
        ``{"path": ...}``.

        Raises:
            RecorderError: ``to_file`` without a ``dump_dir`` configured.
        """
        record = self.to_dict(physical_to_logical, num_experts, total, passes)
        if not to_file:
            return record
        if not self.dump_dir:
            raise RecorderError(
                "dump to a file needs --expert-distribution-recorder-dir; none was given"
            )
        os.makedirs(self.dump_dir, exist_ok=True)
        stamp = int(time.time() * 1000)
        for n in itertools.count():  # two dumps in one millisecond must not overwrite each other
            path = os.path.join(
                self.dump_dir, f"expert_distribution_{stamp}{f'_{n}' if n else ''}.json"
            )
            try:
                with open(path, "x") as f:
                    json.dump(record, f)
            except FileExistsError:
                continue
            return {"path": path}
        raise AssertionError("unreachable: itertools.count() never ends")
