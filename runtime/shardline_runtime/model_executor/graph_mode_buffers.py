"""ModeBuffers: the static buffers a decode graph needs beyond the batch itself, for LoRA and for
the expert-distribution recorder, so that both modes replay captured graphs.

- **LoRA** (after SGLang's and vLLM's captured LoRA batches): each decode row is one segment of
  the segment kernel. ``lora_starts`` (``arange``), ``lora_lens`` (1: the row has an adapter;
  0: base model or padding) and ``lora_slots`` (the row's adapter slot) are (max_bs,) int32
  buffers at fixed addresses; the kernel reads them inside the graph, and each replay only
  rewrites them. Adapters load into the wrappers' slot buffers in place, so a graph captured
  before an adapter was loaded serves it afterwards.
- **Recorder**: ``row_mask`` (max_bs,) int64, 1 for real rows and 0 for padded ones; the
  recorder's counts are written into its static ``_pass_counts`` inside the graph, weighted by
  the mask (``layers/moe/recorder.py``).

On CPU the same buffers drive the static-buffer path eagerly (the LoRA wrappers gather each
row's A/B by slot instead of running the kernel).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class ModeBuffers:
    """LoRA and recorder buffers of one ``CudaGraphRunner`` (either part absent when the
    runner has no LoRA manager / no EPLB manager).

    Args:
        model_runner: provides ``lora_manager`` and ``eplb_manager`` (either may be None).
        max_bs: rows of every buffer. device: where they live.
    """

    def __init__(self, model_runner: Any, max_bs: int, device: torch.device):
        self.lora = model_runner.lora_manager
        eplb = model_runner.eplb_manager
        self.recorder = eplb.recorder if eplb is not None else None

        def zeros(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(max_bs, dtype=dtype, device=device)

        self.lora_starts = torch.arange(max_bs, dtype=torch.int32, device=device)
        self.lora_lens, self.lora_slots = zeros(torch.int32), zeros(torch.int32)
        self.row_mask = zeros(torch.int64)

    def fill(self, lora_names: list[str | None] | None, bs: int, padded: int) -> None:
        """Rows ``0..bs-1`` from the batch (their adapters), ``bs..padded-1`` padding.

        Raises:
            LoRAAdapterError: a row names an adapter that is not loaded.
        """
        if self.lora is not None:
            slots = self.lora.row_slots(lora_names, bs) + [-1] * (padded - bs)
            host = torch.tensor([[max(s, 0), int(s >= 0)] for s in slots], dtype=torch.int32)
            self.lora_slots[:padded].copy_(host[:, 0])
            self.lora_lens[:padded].copy_(host[:, 1])
        if self.recorder is not None:
            self.row_mask[:bs] = 1
            self.row_mask[bs:padded] = 0

    def fill_padding(self, start: int, end: int) -> None:
        """Rows ``start..end-1`` as padding: no adapter, not counted."""
        self.lora_lens[start:end] = 0
        self.lora_slots[start:end] = 0
        self.row_mask[start:end] = 0

    @contextmanager
    def bound(self, padded: int) -> Iterator[None]:
        """While capturing (or running the static path) a step of ``padded`` rows: the LoRA
        layout is these buffers, and the recorder records through the row mask."""
        if self.lora is not None:
            self.lora.bind_rows(
                self.lora_starts[:padded], self.lora_lens[:padded], self.lora_slots[:padded]
            )
        if self.recorder is not None:
            self.recorder.capturing, self.recorder.row_mask = True, self.row_mask
        try:
            yield
        finally:
            if self.recorder is not None:
                self.recorder.capturing, self.recorder.row_mask = False, None
