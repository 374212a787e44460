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
from shardline_runtime.layers.linear_params import create_params
from shardline_runtime.layers.parameter import (
    ShardId,
    checkpoint_shapes_of,
    quantizes_on_load,
    shard_layout_of,
)
from shardline_runtime.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    UnquantizedLinearMethod,
    layer_tensor,
)
from shardline_runtime.layers.quantization.fp8_numerics import quantize_into

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


class _TPLinear(nn.Module):
    """A linear layer whose parameters come from its ``LinearMethod`` (``quant_config`` picks
    it for the checkpoint modules ``prefixes``; unquantized when None)."""

    weight: nn.Parameter  # the unquantized method's (LoRA wraps only those)
    bias: nn.Parameter | None

    def __init__(
        self,
        tp_rank: int | None,
        tp_size: int | None,
        quant_config: QuantizationConfig | None,
        prefixes: list[str],
    ):
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tensor_model_parallel_world_size() if tp_size is None else tp_size
        self.quant_method: LinearMethod = (
            UnquantizedLinearMethod()
            if quant_config is None
            else quant_config.linear_method(prefixes or [""])
        )

    def _check(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        what = type(self).__name__ if shard_id is None else f"{type(self).__name__} {shard_id}"
        _check_shape(loaded, checkpoint_shapes_of(param)[shard_id], what)


class ColumnParallelLinear(_TPLinear):
    """``y = x W^T + b`` with W's output rows split over TP ranks.

    Args:
        input_size, output_size: full (unsharded) feature sizes; ``output_size % tp_size == 0``.
        bias: add a bias (sharded like the rows).
        gather_output: all-gather the (..., output_size / tp) result into (..., output_size).
        quant_config, prefix: the checkpoint's quantization and this layer's checkpoint module
            name; every parameter the method asks for is split by output rows like the weight.

    Raises:
        QuantizationError: a TP shard boundary would cut a quantization block or pack.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__(tp_rank, tp_size, quant_config, self._prefixes(prefix))
        if output_size % self.tp_size:
            raise ValueError(
                f"output_size {output_size} is not divisible by tp_size {self.tp_size}"
            )
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = output_size // self.tp_size
        self.gather_output = gather_output
        shards = self._shard_sizes()
        self.quant_method.check_partition(list(shards.values()), input_size, self.tp_size)
        create_params(
            self,
            self.quant_method,
            shards,
            input_size,
            self.output_size_per_partition,
            input_size,
            bias,
            "output",
            self.weight_loader,
        )
        rows = [self._shard_rows(s)[1] for s in shards]
        self.register_buffer(
            "shard_of_row",
            torch.repeat_interleave(
                torch.arange(len(rows)), torch.tensor(rows), output_size=sum(rows)
            ),
            persistent=False,
        )

    def _prefixes(self, prefix: str) -> list[str]:
        """The checkpoint module names this layer loads (one per fused shard)."""
        return [prefix]

    def _shard_sizes(self) -> dict:
        """Shard id -> full output rows of the checkpoint tensor loaded into it."""
        return {None: self.output_size}

    def _shard_index(self, shard_id: ShardId) -> int:
        return 0

    def _shard_rows(self, shard_id: ShardId) -> tuple[int, int, int]:
        """(offset in this rank's rows, rows, index of the source slice) of a shard."""
        return 0, self.output_size_per_partition, self.tp_rank

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        offset, n, src = self._shard_rows(shard_id)
        self._check(param, loaded, shard_id)
        layout = shard_layout_of(param)
        if layout.per_shard:
            param.data[self._shard_index(shard_id)].copy_(loaded)
            return
        dim, block = layout.output_dim, layout.output_block
        assert dim is not None
        rows = loaded.narrow(dim, src * n // block, n // block)
        dest = param.data.narrow(dim, offset // block, n // block)
        if quantizes_on_load(param):
            scale = layer_tensor(self, "weight_scale").data.narrow(0, offset, n)
            quantize_into(rows, dest, scale)
        else:
            dest.copy_(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)  # (T, out / tp)
        return tensor_model_parallel_all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel layers of ``output_sizes`` fused (e.g. [gate, up]); each rank holds
    ``[gate shard | up shard]``. ``weight_loader(param, loaded, shard_id)`` takes the index;
    ``prefix`` names the fused layer, ``shard_names`` the checkpoint modules it is made of."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        shard_names: tuple[str, ...] = ("gate_proj", "up_proj"),
    ):
        self.output_sizes = list(output_sizes)
        self.shard_names = shard_names
        tp = get_tensor_model_parallel_world_size() if tp_size is None else tp_size
        for size in self.output_sizes:
            if size % tp:
                raise ValueError(f"output size {size} is not divisible by tp_size {tp}")
        super().__init__(
            input_size,
            sum(output_sizes),
            bias=bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
            quant_config=quant_config,
            prefix=prefix,
        )

    def _prefixes(self, prefix: str) -> list[str]:
        return [f"{prefix.rpartition('.')[0]}.{name}".lstrip(".") for name in self.shard_names]

    def _shard_sizes(self) -> dict:
        return dict(enumerate(self.output_sizes))

    def _shard_index(self, shard_id: ShardId) -> int:
        return int(shard_id)

    def _shard_rows(self, shard_id: ShardId) -> tuple[int, int, int]:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be in [0, {len(self.output_sizes)}), got {shard_id}")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        return offset, self.output_sizes[shard_id] // self.tp_size, self.tp_rank


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. Per rank the output is ``[q (num_heads*head_dim) | k | v
    (num_kv_heads*head_dim each)]`` with ``num_heads = total_num_heads / tp`` and
    ``num_kv_heads = max(1, total_num_kv_heads / tp)``.

    ``weight_loader(param, loaded, shard_id)`` with ``shard_id`` in {"q", "k", "v"}; ``prefix``
    names the fused layer (``...self_attn.qkv_proj``), loaded from ``q_proj``/``k_proj``/``v_proj``.
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
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
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
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(
            hidden_size,
            out,
            bias=bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
            quant_config=quant_config,
            prefix=prefix,
        )

    def _prefixes(self, prefix: str) -> list[str]:
        head = prefix.rpartition(".")[0]
        return [f"{head}.{s}_proj".lstrip(".") for s in "qkv"]

    def _shard_sizes(self) -> dict:
        kv = self.total_num_kv_heads * self.head_dim
        return {"q": self.total_num_heads * self.head_dim, "k": kv, "v": kv}

    def _shard_index(self, shard_id: ShardId) -> int:
        return "qkv".index(shard_id)

    def _shard_rows(self, shard_id: ShardId) -> tuple[int, int, int]:
        if shard_id == "q":
            return 0, self.q_size, self.tp_rank
        if shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            return offset, self.kv_size, self.tp_rank // self.num_kv_replicas
        raise ValueError(f"shard_id must be one of 'q', 'k', 'v', got {shard_id!r}")


class RowParallelLinear(_TPLinear):
    """``y = all_reduce(x_shard W_shard^T) + b`` with W's input columns split over TP ranks.

    Args:
        input_size, output_size: full sizes; ``input_size % tp_size == 0``. The input is
            already split (the output of a column-parallel layer).
        reduce_results: all-reduce the partial sums (False leaves them to the caller).
        quant_config, prefix: as for :class:`ColumnParallelLinear`; every parameter the method
            asks for is split by input columns like the weight (a per-channel scale, indexed by
            output rows only, is replicated).

    Raises:
        QuantizationError: a TP shard boundary would cut a quantization block or pack.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__(tp_rank, tp_size, quant_config, [prefix])
        if input_size % self.tp_size:
            raise ValueError(f"input_size {input_size} is not divisible by tp_size {self.tp_size}")
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = input_size // self.tp_size
        self.reduce_results = reduce_results
        self.quant_method.check_partition([output_size], input_size, self.tp_size)
        create_params(
            self,
            self.quant_method,
            {None: output_size},
            input_size,
            output_size,
            self.input_size_per_partition,
            bias,
            "input",
            self.weight_loader,
        )
        self.register_buffer(
            "shard_of_row", torch.zeros(output_size, dtype=torch.long), persistent=False
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        self._check(param, loaded, None)
        layout = shard_layout_of(param)
        if layout.per_shard:
            param.data[0].copy_(loaded)
        elif layout.input_dim is None:  # bias, per-channel scales: replicated
            param.data.copy_(loaded)
        else:
            dim, block = layout.input_dim, layout.input_block
            n = self.input_size_per_partition // block
            columns = loaded.narrow(dim, self.tp_rank * n, n)
            if quantizes_on_load(param):
                quantize_into(columns, param.data, layer_tensor(self, "weight_scale").data)
            else:
                param.data.copy_(columns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (T, out) partial sum over this rank's input columns
        y = self.quant_method.apply(self, x)
        if self.reduce_results:
            y = tensor_model_parallel_all_reduce(y)
        # the bias is added once: after the all-reduce, or (unreduced) by rank 0 only
        if self.bias is not None and (self.reduce_results or self.tp_rank == 0):
            y = y + self.bias
        return y
