"""A decode step's index tensors on the CPU without a torch call per step (host work, issue 24).

``ForwardBatch.init_new`` builds a decode step's ``req_pool_indices``, ``seq_lens`` and
``positions`` as one new tensor from Python lists and unbinds it: about 50 µs of torch calls per
step with warm caches, and several times that in a real loop, where the model's forward has just
evicted the host path's code and data from the caches (``bench/host_overhead.py``). On the CPU
:class:`HostDecodeInputs` instead writes the three rows through a NumPy view into buffers it
allocated once, and hands out tensor views of them that it made once per ring slot and batch
size: no torch call in steady decode.

The buffers form a ring of :data:`RING` slots, used in turn, so the tensors of the last few steps
stay as they were while something may still hold them (the overlap loop keeps the step in flight
and the ``FutureMap``'s deferred store of the step before it; nothing holds a step's tensors
for more than two steps). On the CPU the forward is synchronous, so a slot is never written while
a step reads it. Devices other than the CPU keep ``init_new``'s non-blocking copy.
"""

from __future__ import annotations

import torch

RING = 4  # slots in turn; a step's tensors stay unchanged for the next RING - 1 steps


class HostDecodeInputs:
    """Ring buffers for the per-request index rows of CPU decode steps.

    Attributes:
        capacity: the largest batch the buffers hold now (they grow on demand).
    """

    def __init__(self, capacity: int = 64):
        self._alloc(capacity)
        self._next = 0

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        # (RING, 3, capacity) int64: per slot, the rows req_pool_indices, seq_lens, positions
        self._buffer = torch.zeros((RING, 3, capacity), dtype=torch.int64)
        self._host = self._buffer.numpy()
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def rows(
        self, req_pool_indices: list[int], seq_lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(req_pool_indices, seq_lens, positions)`` as (bs,) int64 CPU tensors (``positions =
        seq_lens - 1``, the one new token of each request), written into the next ring slot.

        Raises:
            ValueError: the two lists differ in length.
        """
        bs = len(req_pool_indices)
        if len(seq_lens) != bs:
            raise ValueError(f"seq_lens has {len(seq_lens)} entries but req_pool_indices has {bs}")
        if bs > self.capacity:
            self._alloc(max(bs, 2 * self.capacity))
        slot = self._next
        self._next = (slot + 1) % RING
        host = self._host[slot]
        if bs == 1:  # element writes: cheaper than converting one-element lists
            host[0, 0] = req_pool_indices[0]
            host[1, 0] = n = seq_lens[0]
            host[2, 0] = n - 1
        else:
            host[0, :bs] = req_pool_indices
            host[1, :bs] = seq_lens
            host[2, :bs] = host[1, :bs]
            host[2, :bs] -= 1
        views = self._views.get((slot, bs))
        if views is None:
            buf = self._buffer[slot]
            views = self._views[(slot, bs)] = (buf[0, :bs], buf[1, :bs], buf[2, :bs])
        return views
