"""Prefix cache: a radix tree over token ids whose nodes own KV slots (SGLang's RadixCache).

Each edge holds a run of token ids (``key``) and the KV slots of those tokens (``value``, int64).
A request's prompt is matched against the tree at admission; the matched slots are reused as its
cached prefix (``cached_len``), so only the rest is prefilled. When a request finishes (or a
prefill chunk ends) its tokens and slots are inserted; slots duplicating an existing entry are
freed at once. Nodes used by running requests are locked (``lock_ref > 0``); unlocked leaves are
evicted least-recently-used first when the KV pool runs short.

Invariant (checked in tests): every KV slot is either free in the allocator, held by exactly one
tree node, or held by exactly one running request outside the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

import torch

_clock = itertools.count()


class TreeNode:
    """One edge of the radix tree: ``key`` token ids and their KV slots ``value`` (int64)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: TreeNode | None = None):
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key: list[int] = []
        self.value: torch.Tensor = torch.zeros(0, dtype=torch.int64)
        self.lock_ref = 0
        self.last_access = next(_clock)

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access < other.last_access


def _match_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache:
    """Token-id radix tree owning KV slots.

    Args:
        free_slots: callback returning slots to the KV allocator, e.g.
            ``TokenToKVPoolAllocator.free`` (takes a (n,) int64 tensor).
        disable: when True the cache stores nothing: ``match_prefix`` always misses and
            ``insert`` returns ``len(key)``, so the caller frees every slot it passed.
    """

    def __init__(self, free_slots: Callable[[torch.Tensor], None], disable: bool = False):
        self._free_slots = free_slots
        self.disable = disable
        self.reset_tree()

    def reset_tree(self) -> None:
        """Forget every node without freeing slots (use :meth:`reset` to free them)."""
        self.root = TreeNode()
        self.root.lock_ref = 1
        self._evictable_size = 0
        self._protected_size = 0

    def reset(self) -> None:
        """Free every slot the tree holds and empty it (requires no locked node but the root)."""
        if self._protected_size:
            raise RuntimeError(
                f"cannot flush the prefix cache: {self._protected_size} tokens are in use by running requests"
            )
        for node in self._all_nodes():
            if node is not self.root and len(node.value):
                self._free_slots(node.value)
        self.reset_tree()

    def evictable_size(self) -> int:
        """Tokens held by unlocked nodes (reclaimable by :meth:`evict`)."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Tokens held by nodes locked by running requests."""
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def match_prefix(self, key: Sequence[int]) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of ``key``.

        Returns:
            ``(slots, last_node)``: (m,) int64 KV slots of the first ``m`` tokens of ``key``
            and the node where the match ends (split so that it ends exactly there); pass
            ``last_node`` to :meth:`inc_lock_ref` while the slots are in use.
        """
        if self.disable or not key:
            return torch.zeros(0, dtype=torch.int64), self.root
        node = self.root
        values: list[torch.Tensor] = []
        pos = 0
        while pos < len(key) and key[pos] in node.children:
            child = node.children[key[pos]]
            child.last_access = next(_clock)
            n = _match_len(child.key, key[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            values.append(child.value)
            pos += n
            node = child
        slots = torch.cat(values) if values else torch.zeros(0, dtype=torch.int64)
        return slots, node

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        """Insert tokens ``key`` with KV slots ``value`` ((len(key),) int64).

        Returns:
            How many leading tokens were already in the tree. The caller owns (and must free)
            ``value[:returned]`` when those slots differ from the tree's; the rest now belongs
            to the tree.
        """
        if len(value) != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {len(value)} KV slots")
        if self.disable:
            return len(key)
        key = list(key)
        node = self.root
        pos = 0
        while pos < len(key):
            first = key[pos]
            if first not in node.children:
                leaf = TreeNode(node)
                leaf.key = key[pos:]
                leaf.value = value[pos:].clone()
                node.children[first] = leaf
                self._evictable_size += len(leaf.key)
                return pos
            child = node.children[first]
            child.last_access = next(_clock)
            n = _match_len(child.key, key[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            pos += n
            node = child
        return pos

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split ``child`` after its first ``n`` tokens; return the new upper node."""
        parent = child.parent
        assert parent is not None, "the root is never split"
        upper = TreeNode(parent)
        upper.key, upper.value = child.key[:n], child.value[:n]
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[upper.key[0]] = upper
        child.key, child.value = child.key[n:], child.value[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (a request uses their slots)."""
        current: TreeNode | None = node
        while current is not None and current is not self.root:
            if current.lock_ref == 0:
                self._evictable_size -= len(current.key)
                self._protected_size += len(current.key)
            current.lock_ref += 1
            current = current.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one :meth:`inc_lock_ref` of ``node``."""
        current: TreeNode | None = node
        while current is not None and current is not self.root:
            if current.lock_ref == 1:
                self._evictable_size += len(current.key)
                self._protected_size -= len(current.key)
            if current.lock_ref <= 0:
                raise RuntimeError("radix cache lock_ref underflow")
            current.lock_ref -= 1
            current = current.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unlocked leaves, LRU first (fewer if not possible).

        Returns:
            The number of slots freed.
        """
        heap = [
            n
            for n in self._all_nodes()
            if not n.children and n.lock_ref == 0 and n is not self.root
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self._free_slots(leaf.value)
            freed += len(leaf.value)
            self._evictable_size -= len(leaf.key)
            parent = leaf.parent
            assert parent is not None, "the root is never a leaf on the heap"
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _all_nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
