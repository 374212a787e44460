"""LoRA wrappers around the tensor-parallel linear layers (after SGLang's ``lora/layers.py`` and
vLLM's ``lora/layers``): ``y = base(x) + scaling * B (A x)`` with a per-token adapter slot.

TP sharding follows the wrapped layer, as SGLang and vLLM do:
- column-parallel (``qkv_proj``, ``gate_up_proj``): A (r, in) is replicated; B (out, r) is split
  over its output rows exactly like the base weight (q by heads, k/v by KV head with the same
  replication, gate/up each in half), so the delta lands on this rank's output columns.
- row-parallel (``o_proj``, ``down_proj``): A is split over its input columns like the base
  weight, B is replicated; ``B (A_shard x_shard)`` is this rank's partial sum, added *before*
  the layer's one all-reduce, so LoRA adds no communication.

Buffers per wrapped layer: ``lora_a`` (num_slots, num_subs * max_rank, in_per_rank) and
``lora_b`` (num_slots, out_per_rank, max_rank), zero-padded beyond an adapter's rank; the
scaling is folded into B at load time. Fused layers hold one A/B pair per HF module
(``q_proj``/``k_proj``/``v_proj``; ``gate_proj``/``up_proj``): sub ``i`` uses A rows
``[i*R, (i+1)*R)`` and writes output columns ``[offset_i, offset_i + n_i)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardline_runtime.distributed import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from shardline_runtime.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    linear,
)
from shardline_runtime.lora.lora_config import LoRAAdapterError


@dataclass
class LoRABatchInfo:
    """The adapter layout of one forward step, shared by every wrapper.

    ``groups``: ``(slot, token_indices)`` per adapter present (int64 (T_s,) on the model device);
    base-model tokens are in no group. ``seg_slots``/``seg_starts``/``seg_lens``: the same as
    contiguous segments (one per request run), used by the GPU segment kernel.
    """

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    seg_slots: list[int] = field(default_factory=list)
    seg_starts: list[int] = field(default_factory=list)
    seg_lens: list[int] = field(default_factory=list)
    # GPU: the segments as int32 device tensors (starts, lens, slots) for the Triton kernel
    seg_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    max_seg_len: int = 0  # the longest segment (sizes the kernel's grid)
    # A decode graph's static layout (one row per segment, ``LoRAManager.bind_rows``): slots
    # (T,) and lens (T,) int32 (1: the row has an adapter, 0: base model or padding); the CPU
    # static-buffer path gathers each row's A/B by slot, the GPU runs the segment kernel on them.
    row_layout: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def active(self) -> bool:
        """Whether the wrappers add a delta this step (an adapter is present, or a decode
        graph's static layout is bound: captured once, its rows decide at replay)."""
        return bool(self.groups) or self.row_layout is not None or self.seg_tensors is not None


@dataclass(frozen=True)
class SubModule:
    """One HF module inside a (possibly fused) layer: its name suffix, full output rows in the
    checkpoint, this rank's output rows ``[offset, offset + size)`` and the source row block."""

    name: str
    full_out: int
    offset: int
    size: int
    src_block: int


def column_submodules(layer: ColumnParallelLinear, own_name: str) -> list[SubModule]:
    """The HF modules a column-parallel layer holds (q/k/v, gate/up, or itself)."""
    if isinstance(layer, QKVParallelLinear):
        hd, r = layer.head_dim, layer.tp_rank
        kv_src = r // layer.num_kv_replicas
        return [
            SubModule("q_proj", layer.total_num_heads * hd, 0, layer.q_size, r),
            SubModule("k_proj", layer.total_num_kv_heads * hd, layer.q_size, layer.kv_size, kv_src),
            SubModule(
                "v_proj",
                layer.total_num_kv_heads * hd,
                layer.q_size + layer.kv_size,
                layer.kv_size,
                kv_src,
            ),
        ]
    if isinstance(layer, MergedColumnParallelLinear) and own_name == "gate_up_proj":
        g, u = (s // layer.tp_size for s in layer.output_sizes)
        return [
            SubModule("gate_proj", layer.output_sizes[0], 0, g, layer.tp_rank),
            SubModule("up_proj", layer.output_sizes[1], g, u, layer.tp_rank),
        ]
    n = layer.output_size_per_partition
    return [SubModule(own_name, layer.output_size, 0, n, layer.tp_rank)]


class _LoRAWrapper(nn.Module):
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def __init__(
        self,
        base: ColumnParallelLinear | RowParallelLinear,
        subs: list[SubModule],
        in_per_rank: int,
        out_per_rank: int,
        num_slots: int,
        max_rank: int,
        batch_info: LoRABatchInfo,
    ):
        super().__init__()
        # The base layer is held outside ``_modules`` and its parameters registered under their
        # own names, so parameter names (checkpoint loading, weight updates) do not change.
        object.__setattr__(self, "base", base)
        self._parameters["weight"] = base.weight
        if base.bias is not None:
            self._parameters["bias"] = base.bias
        self.subs = subs
        self.max_rank = max_rank
        self.batch_info = batch_info
        dtype, device = base.weight.dtype, base.weight.device
        n_a = len(subs) * max_rank if isinstance(base, ColumnParallelLinear) else max_rank
        self.register_buffer(
            "lora_a",
            torch.zeros(num_slots, n_a, in_per_rank, dtype=dtype, device=device),
            persistent=False,
        )
        self.register_buffer(
            "lora_b",
            torch.zeros(num_slots, out_per_rank, max_rank, dtype=dtype, device=device),
            persistent=False,
        )

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # sizes and tp facts of the wrapped layer (q_size, output_size...)
            return getattr(self.__dict__["base"], name)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def add_lora_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[t] += B_s (A_s x[t])`` for every token ``t`` of an adapter slot ``s`` (in place).
        x (T, in_per_rank), y (T, out_per_rank). GPU: the Triton segment kernel
        (``triton_segment.py``); CPU: one GEMM pair per adapter over its gathered tokens."""
        info = self.batch_info
        if info.seg_tensors is not None:
            from shardline_runtime.lora.triton_segment import segment_lora_delta

            column = isinstance(self.base, ColumnParallelLinear)
            ranges = [(s.offset, s.size) for s in self.subs] if column else [(0, y.shape[1])]
            segment_lora_delta(
                x,
                y,
                self.lora_a,
                self.lora_b,
                ranges,
                self.max_rank,
                info.seg_tensors,
                info.max_seg_len,
            )
            return
        if info.row_layout is not None:
            self._add_row_delta(x, y, *info.row_layout)
            return
        R = self.max_rank
        for slot, idx in self.batch_info.groups:
            xa = linear(x.index_select(0, idx), self.lora_a[slot])  # (T_s, n_subs * R)
            delta = torch.empty(idx.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
            if len(self.subs) == 1 or not isinstance(self.base, ColumnParallelLinear):
                delta = linear(xa, self.lora_b[slot])
            else:
                for i, sub in enumerate(self.subs):
                    b = self.lora_b[slot, sub.offset : sub.offset + sub.size]  # (n_i, R)
                    delta[:, sub.offset : sub.offset + sub.size] = linear(
                        xa[:, i * R : (i + 1) * R], b
                    )
            y.index_add_(0, idx, delta)

    def _add_row_delta(
        self, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor
    ) -> None:
        """The static row layout without the kernel: row ``t`` adds ``B_s (A_s x[t])`` of its
        slot ``s`` times ``lens[t]`` (0 or 1). Shape-static and sync-free, like the kernel."""
        R, index = self.max_rank, slots.long()
        on = lens.to(x.dtype).unsqueeze(1)  # (T, 1)
        xa = torch.bmm(self.lora_a.index_select(0, index), x.unsqueeze(2)).squeeze(2) * on
        column = isinstance(self.base, ColumnParallelLinear)
        ranges = [(s.offset, s.size) for s in self.subs] if column else [(0, y.shape[1])]
        b = self.lora_b.index_select(0, index)  # (T, out, R)
        for i, (offset, size) in enumerate(ranges):
            part = xa[:, i * R : (i + 1) * R].unsqueeze(2)  # (T, R, 1)
            y[:, offset : offset + size] += torch.bmm(b[:, offset : offset + size], part).squeeze(2)


class ColumnParallelLinearWithLoRA(_LoRAWrapper):
    """A column-parallel layer plus LoRA; forward (T, in) -> (T, out_per_rank) (or gathered)."""

    def __init__(
        self,
        base: ColumnParallelLinear,
        own_name: str,
        num_slots: int,
        max_rank: int,
        batch_info: LoRABatchInfo,
    ):
        super().__init__(
            base,
            column_submodules(base, own_name),
            base.input_size,
            base.output_size_per_partition,
            num_slots,
            max_rank,
            batch_info,
        )

    def load_slot(
        self,
        slot: int,
        weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
        scaling: float,
        where: str,
        check_only: bool = False,
    ) -> None:
        """Copy this rank's part of ``{sub_name: (A (r, in), B (full_out, r))}`` into ``slot``.

        ``check_only``: validate, copy nothing.

        Raises:
            LoRAAdapterError: a shape does not fit the base layer (wrong base architecture).
        """
        if not check_only:
            self.clear_slot(slot)
        R = self.max_rank
        for i, sub in enumerate(self.subs):
            if sub.name not in weights:
                continue
            a, b = weights[sub.name]
            r = a.shape[0]
            if a.shape != (r, self.base.input_size) or b.shape != (sub.full_out, r):
                raise LoRAAdapterError(
                    f"wrong base architecture: {where}.{sub.name} has lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, "
                    f"the base layer needs ({r}, {self.base.input_size}) / ({sub.full_out}, {r})"
                )
            if check_only:
                continue
            self.lora_a[slot, i * R : i * R + r] = a.to(self.lora_a.dtype)
            shard = b.narrow(0, sub.src_block * sub.size, sub.size) * scaling
            self.lora_b[slot, sub.offset : sub.offset + sub.size, :r] = shard.to(self.lora_b.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.base.weight, self.base.bias)  # (T, out / tp)
        if self.batch_info.active:
            self.add_lora_delta(x, y)
        return tensor_model_parallel_all_gather(y, dim=-1) if self.base.gather_output else y


class RowParallelLinearWithLoRA(_LoRAWrapper):
    """A row-parallel layer plus LoRA; the delta joins the partial sum before the all-reduce."""

    def __init__(
        self,
        base: RowParallelLinear,
        own_name: str,
        num_slots: int,
        max_rank: int,
        batch_info: LoRABatchInfo,
    ):
        sub = SubModule(own_name, base.output_size, 0, base.output_size, 0)
        super().__init__(
            base,
            [sub],
            base.input_size_per_partition,
            base.output_size,
            num_slots,
            max_rank,
            batch_info,
        )

    def load_slot(
        self,
        slot: int,
        weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
        scaling: float,
        where: str,
        check_only: bool = False,
    ) -> None:
        """Copy ``{name: (A (r, in), B (out, r))}``: A's input columns of this rank, all of B.

        ``check_only``: validate, copy nothing.

        Raises:
            LoRAAdapterError: a shape does not fit the base layer (wrong base architecture).
        """
        if not check_only:
            self.clear_slot(slot)
        name = self.subs[0].name
        if name not in weights:
            return
        a, b = weights[name]
        r = a.shape[0]
        base = self.base
        if a.shape != (r, base.input_size) or b.shape != (base.output_size, r):
            raise LoRAAdapterError(
                f"wrong base architecture: {where}.{name} has lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, "
                f"the base layer needs ({r}, {base.input_size}) / ({base.output_size}, {r})"
            )
        if check_only:
            return
        n = base.input_size_per_partition
        self.lora_a[slot, :r] = a.narrow(1, base.tp_rank * n, n).to(self.lora_a.dtype)
        self.lora_b[slot, :, :r] = (b * scaling).to(self.lora_b.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        y = linear(x, base.weight)  # (T, out) partial sum over this rank's input columns
        if self.batch_info.active:
            self.add_lora_delta(x, y)
        if base.reduce_results:
            y = tensor_model_parallel_all_reduce(y)
        if base.bias is not None and (base.reduce_results or base.tp_rank == 0):
            y = y + base.bias
        return y
