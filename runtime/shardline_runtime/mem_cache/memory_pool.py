"""KV-cache memory pools: request rows, per-layer K/V buffers and a free-slot allocator.

Two-level mapping as in SGLang: ``ReqToTokenPool.req_to_token[row, i]`` is the KV slot of token
``i`` of the request that owns ``row``; ``TokenToKVPool`` holds, per layer, K and V for every
slot. Slot 0 is the dummy slot: padded rows of a captured CUDA graph write their K/V there, so
the allocator never hands it out and the buffers have ``size + 1`` rows.

Host and device (overlap scheduling never waits on the device while it prepares a step): the
allocator's free list and every slot index it hands out live on the host, and
``ReqToTokenPool`` keeps a host copy of ``req_to_token`` beside the device one. The scheduler
reads only host state; writes go to both, the device one as a non-blocking copy queued on the
current stream (``device_copy.to_device``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shardline_runtime.device_copy import to_device

DUMMY_SLOT = 0


class ReqToTokenPool:
    """Rows mapping each running request's token positions to KV slots.

    Args:
        size: number of request rows (maximum concurrently running requests).
        max_context_len: tokens per row (the longest request, prompt + output).
        device: where ``req_to_token`` lives.
        host_copy: keep a separate host copy (default: when ``device`` is not the CPU; on the
            CPU the host copy is ``req_to_token`` itself).

    Attributes:
        req_to_token: (size, max_context_len) int64 on ``device``; unused entries are
            ``DUMMY_SLOT``. Read by the attention backends.
        req_to_token_host: the same table on the host, what the scheduler reads (never
            ``req_to_token``, which would wait for the step in flight).

    Raises:
        ValueError: ``size`` or ``max_context_len`` < 1.
    """

    def __init__(
        self,
        size: int,
        max_context_len: int,
        device: torch.device | str = "cpu",
        host_copy: bool | None = None,
    ):
        if size < 1 or max_context_len < 1:
            raise ValueError(
                f"ReqToTokenPool needs size >= 1 and max_context_len >= 1, got {size}, {max_context_len}"
            )
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(
            (size, max_context_len), dtype=torch.int64, device=self.device
        )
        if host_copy is None:
            host_copy = self.device.type != "cpu"
        self.req_to_token_host = (
            torch.zeros((size, max_context_len), dtype=torch.int64)
            if host_copy
            else self.req_to_token
        )
        self.free_slots: list[int] = list(range(size))

    @property
    def req_to_token_host(self) -> torch.Tensor:
        return self._host

    @req_to_token_host.setter
    def req_to_token_host(self, table: torch.Tensor) -> None:
        self._host = table
        self._host_np = table.numpy()  # the same memory: element writes go through NumPy

    def available_size(self) -> int:
        """Number of free request rows."""
        return len(self.free_slots)

    def alloc(self, need_size: int) -> list[int] | None:
        """Take ``need_size`` free rows; ``None`` (nothing taken) when fewer are free."""
        if need_size < 0:
            raise ValueError(f"need_size must be >= 0, got {need_size}")
        if need_size > len(self.free_slots):
            return None
        rows, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return rows

    def free(self, indices: int | list[int]) -> None:
        """Return rows to the pool.

        Raises:
            ValueError: a row is out of range or already free (double free).
        """
        rows = [indices] if isinstance(indices, int) else [int(i) for i in indices]
        free = set(self.free_slots)
        for row in rows:
            if not 0 <= row < self.size or row in free:
                raise ValueError(
                    f"cannot free request row {row}: out of [0, {self.size}) or already free"
                )
            free.add(row)
        self.free_slots.extend(rows)

    def write(self, indices: Any, values: torch.Tensor) -> None:
        """``req_to_token[indices] = values`` on the host copy and the device table.

        Args:
            indices: an index expression over (row, position): ints, slices, or host int64
                tensors.
            values: host int64 KV slots (any shape the expression takes).
        """
        values = values.to(torch.int64)
        self.req_to_token_host[indices] = values
        if self.req_to_token_host is self.req_to_token:
            return
        if isinstance(indices, tuple):
            indices = tuple(
                to_device(i, self.device) if isinstance(i, torch.Tensor) else i for i in indices
            )
        self.req_to_token[indices] = to_device(values, self.device)

    def write_tokens(
        self, rows: list[int], positions: list[int], slots: torch.Tensor | np.ndarray
    ) -> None:
        """``req_to_token[rows[i], positions[i]] = slots[i]`` for every i (a decode step's one
        new slot per request), on the host copy and the device table.

        Args:
            rows / positions: host ints, one per new token.
            slots: (len(rows),) int64 host KV slots (a tensor or a NumPy array).
        """
        values = slots if isinstance(slots, np.ndarray) else slots.numpy()
        if len(rows) == 1:  # batch 1: an element write, no index arrays
            self._host_np[rows[0], positions[0]] = values[0]
        else:
            self._host_np[rows, positions] = values
        if self.req_to_token_host is self.req_to_token:
            return
        index = to_device([rows, positions], self.device, torch.int64)
        self.req_to_token[index[0], index[1]] = to_device(torch.from_numpy(values), self.device)

    def slots(self, row: int, start: int, end: int) -> torch.Tensor:
        """(end - start,) int64 KV slots of positions ``[start, end)`` of ``row``, read from the
        host copy (a new tensor the caller may keep)."""
        return self.req_to_token_host[row, start:end].clone()

    def clear(self) -> None:
        """Free every row."""
        self.free_slots = list(range(self.size))


class TokenToKVPool:
    """Per-layer K and V buffers indexed by KV slot.

    Args:
        size: usable slots (tokens); buffers have ``size + 1`` rows, row 0 being the dummy slot.
        num_layers: transformer layers this pool holds (a pipeline stage's own layers only).
        num_kv_heads_per_rank: KV heads this TP rank holds.
        head_dim: per-head dimension.
        dtype: element dtype of the cache (the KV cache dtype: the model dtype, or an fp8 type).
        device: where the buffers live.
        start_layer: global index of the first layer held (a pipeline stage's ``start_layer``);
            methods take global layer ids ``start_layer .. start_layer + num_layers - 1``.

    Attributes:
        k_buffer_head_major, v_buffer_head_major: lists of ``num_layers`` contiguous tensors
            (num_kv_heads_per_rank, size + 1, head_dim): the storage. Head-major, so gathering a
            request's slots (``index_select`` on dim 1) yields per-head (tokens, head_dim) blocks
            that attention reads contiguously.
        k_buffer, v_buffer: the same storage as (size + 1, num_kv_heads_per_rank, head_dim)
            views (``[slots]`` gives the (T, heads, head_dim) K/V of those slots).
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads_per_rank: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        start_layer: int = 0,
    ):
        if size < 1 or num_layers < 1 or num_kv_heads_per_rank < 1 or head_dim < 1:
            raise ValueError(
                "TokenToKVPool needs size, num_layers, num_kv_heads_per_rank, head_dim >= 1, got "
                f"{size}, {num_layers}, {num_kv_heads_per_rank}, {head_dim}"
            )
        self.size = size
        self.num_layers = num_layers
        self.start_layer = start_layer
        self.num_kv_heads = num_kv_heads_per_rank
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_kv_heads_per_rank, size + 1, head_dim)
        self.k_buffer_head_major = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.v_buffer_head_major = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.k_buffer = [b.transpose(0, 1) for b in self.k_buffer_head_major]
        self.v_buffer = [b.transpose(0, 1) for b in self.v_buffer_head_major]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads_per_rank: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes of K + V cache one token takes across all layers on one rank."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads_per_rank * head_dim * itemsize

    def mem_usage_bytes(self) -> int:
        """Bytes held by all K and V buffers."""
        return sum(b.numel() * b.element_size() for b in self.k_buffer + self.v_buffer)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id - self.start_layer]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id - self.start_layer]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a layer as (size + 1, heads, head_dim) views."""
        i = layer_id - self.start_layer
        return self.k_buffer[i], self.v_buffer[i]

    def get_kv_buffer_head_major(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V storage of a layer: contiguous (heads, size + 1, head_dim)."""
        i = layer_id - self.start_layer
        return self.k_buffer_head_major[i], self.v_buffer_head_major[i]

    def set_kv_buffer(
        self,
        layer_id: int,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Write K/V of new tokens.

        Args:
            layer_id: layer index.
            loc: (T,) int64 slots.
            k, v: (T, num_kv_heads_per_rank, head_dim), stored as ``k / k_scale`` (``v / v_scale``)
                cast to the cache dtype; fp8 values are clamped to the type's finite range first
                (a plain cast of a larger value gives NaN).
        """
        i = layer_id - self.start_layer
        self.k_buffer[i][loc] = self._quantize(k, k_scale)
        self.v_buffer[i][loc] = self._quantize(v, v_scale)

    def _quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if scale != 1.0:
            x = x / scale
        if self.dtype == x.dtype:
            return x
        if self.dtype.is_floating_point and self.dtype.itemsize == 1:
            limit = torch.finfo(self.dtype).max
            x = x.clamp(-limit, limit)
        return x.to(self.dtype)


class TokenToKVPoolAllocator:
    """Free-list allocator of KV slots ``1..size`` (slot 0 is the dummy slot, never handed out).

    The free list lives on the host whatever the model's device: handing out and taking back
    slots never reads the device (the slot indices are host tensors; the step's
    ``out_cache_loc`` goes to the device as a non-blocking copy when the batch is built).

    Args:
        size: number of usable slots.
        device: the model's device (kept for the caller; the free list is on the host).
    """

    def __init__(self, size: int, device: torch.device | str = "cpu"):
        if size < 1:
            raise ValueError(f"TokenToKVPoolAllocator size must be >= 1, got {size}")
        self.size = size
        self.device = torch.device(device)
        self.clear()

    def clear(self) -> None:
        """Free every slot."""
        # NumPy, not torch: an allocation is a slice and one element write, each well under a
        # microsecond in NumPy against a few in torch (a decode step allocates every step)
        self.free_slots = np.arange(1, self.size + 1, dtype=np.int64)
        self.is_free = np.ones(self.size + 1, dtype=np.bool_)
        self.is_free[0] = False

    def available_size(self) -> int:
        """Number of free slots."""
        return int(self.free_slots.shape[0])

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Take ``need_size`` slots: (need_size,) int64 on the host, or ``None`` (nothing taken)
        when short."""
        out = self.alloc_host(need_size)
        return None if out is None else torch.from_numpy(out)

    def alloc_host(self, need_size: int) -> np.ndarray | None:
        """:meth:`alloc` as a NumPy int64 array (a view of the free list, never written again
        by the allocator): no torch call, for a decode step's host bookkeeping."""
        if need_size < 0:
            raise ValueError(f"need_size must be >= 0, got {need_size}")
        if need_size > self.free_slots.shape[0]:
            return None
        out, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        self.is_free[out] = False
        return out

    def free(self, indices: torch.Tensor) -> None:
        """Return slots to the free list.

        Args:
            indices: host int64 slots (from :meth:`alloc`, ``ReqToTokenPool.slots`` or the prefix
                cache).

        Raises:
            ValueError: an index is the dummy slot 0, beyond ``size``, already free, or repeated
                (a double free would hand one slot to two requests), or ``indices`` is not on the
                host.
        """
        if indices.numel() == 0:
            return
        if indices.device.type != "cpu":
            raise ValueError(
                f"KV slots to free must be host tensors (reading {indices.device} would wait "
                "for the device), got one on " + str(indices.device)
            )
        slots = indices.to(torch.int64).flatten().numpy()
        low, high = int(slots.min()), int(slots.max())
        if low < 1 or high > self.size:
            raise ValueError(
                f"KV slots to free must be in [1, {self.size}], got min {low} max {high}"
            )
        if bool(self.is_free[slots].any()) or np.unique(slots).shape[0] != slots.shape[0]:
            raise ValueError("double free of KV slots: some are already free or repeated")
        self.is_free[slots] = True
        self.free_slots = np.concatenate((self.free_slots, slots))
