"""Tensor-parallel linear layers (Megatron-LM column/row split, as in SGLang/vLLM).

Each parameter carries ``weight_loader(param, loaded_weight[, shard_id])`` that takes the full
checkpoint tensor and copies this rank's shard, so TP sharding lives next to the layer.

- ``ColumnParallelLinear``: weight rows (output features) split over ranks; no communication.
- ``MergedColumnParallelLinear``: several column layers stored side by side (gate/up).
- ``QKVParallelLinear``: q, k, v projections side by side; KV heads are replicated when
  ``tp_size > num_kv_heads`` (rank r reads KV head ``r // (tp_size // num_kv_heads)``).
- ``RowParallelLinear``: weight columns (input features) split; its ``forward`` all-reduces
  the partial sums, then adds the bias once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardline_runtime.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from shardline_runtime.layers.parameter import set_weight_attrs

# CPU only: a GEMM of a few rows (decode) against a wide weight runs slower as one MKL call than
# in pieces of this many output features (one thread, M=16: gate/up 768 -> 4096 about 8%, the
# 32000-row LM head about 18% faster in pieces; no gain at 2304 columns or at 512 rows; see
# docs/benchmarks.md). Pieces are contiguous row slices of the weight, so no data is copied.
CPU_SPLIT_OUT_FEATURES = 1024
CPU_SPLIT_MIN_OUT_FEATURES = 4096
CPU_SPLIT_MAX_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x (T, in), weight (out, in) -> (T, out), same values.

    On CPU with at most ``CPU_SPLIT_MAX_ROWS`` rows and at least ``CPU_SPLIT_MIN_OUT_FEATURES``
    output features, computed in slices of ``CPU_SPLIT_OUT_FEATURES`` output features.
    """
    out_features = weight.shape[0]
    if (
        x.device.type != "cpu"
        or x.dim() != 2
        or x.shape[0] > CPU_SPLIT_MAX_ROWS
        or out_features < CPU_SPLIT_MIN_OUT_FEATURES
    ):
        return F.linear(x, weight, bias)
    step = CPU_SPLIT_OUT_FEATURES
    pieces = [
        F.linear(x, weight[i : i + step], None if bias is None else bias[i : i + step])
        for i in range(0, out_features, step)
    ]
    return torch.cat(pieces, dim=-1)


class ShardShapeError(ValueError):
    """A checkpoint tensor has another shape than the layer expects (shapes in the message)."""


def _check_shape(loaded: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ShardShapeError(
            f"{what}: checkpoint shape {tuple(loaded.shape)}, expected {tuple(expected)}"
        )


def _param(shape: tuple[int, ...], loader, checkpoint_shapes: dict) -> nn.Parameter:
    """A parameter of this rank's ``shape`` with its ``weight_loader`` and ``checkpoint_shapes``:
    shard id (None for an unfused tensor) -> the full shape of the checkpoint tensor that
    ``weight_loader(param, tensor[, shard_id])`` takes (read by ``models/weight_loading.py:
    checkpoint_shapes``)."""
    return set_weight_attrs(
        nn.Parameter(torch.empty(shape), requires_grad=False), loader, checkpoint_shapes
    )


class _TPLinear(nn.Module):
    def __init__(self, tp_rank: int | None, tp_size: int | None):
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tensor_model_parallel_world_size() if tp_size is None else tp_size


class ColumnParallelLinear(_TPLinear):
    """``y = x W^T + b`` with W's output rows split over TP ranks.

    Args:
        input_size, output_size: full (unsharded) feature sizes; ``output_size % tp_size == 0``.
        bias: add a bias (sharded like the rows).
        gather_output: all-gather the (..., output_size / tp) result into (..., output_size).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ):
        super().__init__(tp_rank, tp_size)
        if output_size % self.tp_size:
            raise ValueError(
                f"output_size {output_size} is not divisible by tp_size {self.tp_size}"
            )
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = output_size // self.tp_size
        self.gather_output = gather_output
        shards = self._shard_sizes()
        self.weight = _param(
            (self.output_size_per_partition, input_size),
            self.weight_loader,
            {s: (n, input_size) for s, n in shards.items()},
        )
        self.bias = None
        if bias:
            self.bias = _param(
                (self.output_size_per_partition,),
                self.weight_loader,
                {s: (n,) for s, n in shards.items()},
            )

    def _shard_sizes(self) -> dict:
        """Shard id -> full output rows of the checkpoint tensor loaded into it."""
        return {None: self.output_size}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        full = (self.output_size,) + tuple(param.shape[1:])
        _check_shape(loaded, full, type(self).__name__)
        n = self.output_size_per_partition
        param.data.copy_(loaded.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)  # (T, out / tp)
        return tensor_model_parallel_all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel layers of ``output_sizes`` fused (e.g. [gate, up]); each rank holds
    ``[gate shard | up shard]``. ``weight_loader(param, loaded, shard_id)`` takes the index."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias=bias, tp_rank=tp_rank, tp_size=tp_size)
        for size in self.output_sizes:
            if size % self.tp_size:
                raise ValueError(f"output size {size} is not divisible by tp_size {self.tp_size}")

    def _shard_sizes(self) -> dict:
        return dict(enumerate(self.output_sizes))

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        if shard_id is None or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be in [0, {len(self.output_sizes)}), got {shard_id}")
        size = self.output_sizes[shard_id]
        _check_shape(
            loaded, (size,) + tuple(param.shape[1:]), f"{type(self).__name__} shard {shard_id}"
        )
        n = size // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, n).copy_(loaded.narrow(0, self.tp_rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. Per rank the output is ``[q (num_heads*head_dim) | k | v
    (num_kv_heads*head_dim each)]`` with ``num_heads = total_num_heads / tp`` and
    ``num_kv_heads = max(1, total_num_kv_heads / tp)``.

    ``weight_loader(param, loaded, shard_id)`` with ``shard_id`` in {"q", "k", "v"}.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ):
        tp = get_tensor_model_parallel_world_size() if tp_size is None else tp_size
        if total_num_heads % tp:
            raise ValueError(
                f"num_attention_heads {total_num_heads} is not divisible by tp_size {tp}"
            )
        if (total_num_kv_heads >= tp and total_num_kv_heads % tp) or (
            total_num_kv_heads < tp and tp % total_num_kv_heads
        ):
            raise ValueError(
                f"num_key_value_heads {total_num_kv_heads} cannot be split over tp_size {tp}"
            )
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads, self.num_kv_heads = total_num_heads // tp, max(1, total_num_kv_heads // tp)
        self.num_kv_replicas = max(1, tp // total_num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias=bias, tp_rank=tp_rank, tp_size=tp_size)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim

    def _shard_sizes(self) -> dict:
        kv = self.total_num_kv_heads * self.head_dim
        return {"q": self.total_num_heads * self.head_dim, "k": kv, "v": kv}

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None
    ) -> None:
        if shard_id == "q":
            full, n, offset, src = (
                self.total_num_heads * self.head_dim,
                self.q_size,
                0,
                self.tp_rank,
            )
        elif shard_id in ("k", "v"):
            full, n = self.total_num_kv_heads * self.head_dim, self.kv_size
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            src = self.tp_rank // self.num_kv_replicas
        else:
            raise ValueError(f"shard_id must be one of 'q', 'k', 'v', got {shard_id!r}")
        _check_shape(loaded, (full,) + tuple(param.shape[1:]), f"QKVParallelLinear {shard_id}_proj")
        param.data.narrow(0, offset, n).copy_(loaded.narrow(0, src * n, n))


class RowParallelLinear(_TPLinear):
    """``y = all_reduce(x_shard W_shard^T) + b`` with W's input columns split over TP ranks.

    Args:
        input_size, output_size: full sizes; ``input_size % tp_size == 0``. The input is
            already split (the output of a column-parallel layer).
        reduce_results: all-reduce the partial sums (False leaves them to the caller).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ):
        super().__init__(tp_rank, tp_size)
        if input_size % self.tp_size:
            raise ValueError(f"input_size {input_size} is not divisible by tp_size {self.tp_size}")
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = input_size // self.tp_size
        self.reduce_results = reduce_results
        self.weight = _param(
            (output_size, self.input_size_per_partition),
            self.weight_loader,
            {None: (output_size, input_size)},
        )
        self.bias = (
            _param((output_size,), self.weight_loader, {None: (output_size,)}) if bias else None
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # bias: replicated, added once after the all-reduce
            _check_shape(loaded, (self.output_size,), "RowParallelLinear bias")
            param.data.copy_(loaded)
            return
        _check_shape(loaded, (self.output_size, self.input_size), type(self).__name__)
        n = self.input_size_per_partition
        param.data.copy_(loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)  # (T, out) partial sum over this rank's input columns
        if self.reduce_results:
            y = tensor_model_parallel_all_reduce(y)
        # the bias is added once: after the all-reduce, or (unreduced) by rank 0 only
        if self.bias is not None and (self.reduce_results or self.tp_rank == 0):
            y = y + self.bias
        return y
