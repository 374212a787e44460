"""Release and resume a ModelRunner's memory by tag, for RL loops that train on the same devices.

After SGLang's memory saver (``/release_memory_occupation``, ``/resume_memory_occupation``):
the tags are ``weights``, ``kv_cache`` and ``cuda_graph``.

- GPU with ``--enable-memory-saver`` and the ``torch-memory-saver`` package: weights and the KV
  cache are allocated inside its tagged regions; release unmaps their physical memory and resume
  maps new memory at the **same virtual addresses**, so tensors and captured graphs stay valid.
  With ``--enable-weights-cpu-backup`` the package copies the weights to host memory and back.
- Otherwise (CPU, or GPU without the package): each parameter's storage and each KV buffer is
  freed (``param.data = empty``) and allocated again on resume (KV zeroed); with a CPU backup the
  weights are kept as CPU tensors (on a CPU device this is the same memory, so only the KV cache
  shrinks). New addresses mean captured decode graphs are dropped at release and captured again
  at resume.
- Without a CPU backup the weights' values are lost: after resume every checkpoint tensor must
  be written again by a weight update before the server serves (as in SGLang); ``missing``
  counts those not yet written.
- ``cuda_graph`` drops the captured decode graphs and the piecewise EXTEND graphs (and their
  memory pools) until resume.

The caller (Scheduler) releases only while no request holds KV, and flushes the prefix cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterable
from typing import Any

import torch

logger = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache", "cuda_graph")


class MemorySaverError(ValueError):
    """A release/resume request that cannot be honoured (names the tag and the reason)."""


def _torch_memory_saver():
    try:
        from torch_memory_saver import torch_memory_saver
    except ImportError:
        return None
    return torch_memory_saver


def _malloc_trim() -> None:
    """Give freed heap pages back to the OS (glibc), so RSS shows a CPU release at once."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def check_tags(tags: Iterable[str] | None) -> list[str]:
    """``None`` -> every tag; else the tags, each checked.

    Raises:
        MemorySaverError: an unknown tag (lists the allowed ones).
    """
    if tags is None:
        return list(TAGS)
    tags = list(tags)
    for tag in tags:
        if tag not in TAGS:
            raise MemorySaverError(f"tags: unknown tag {tag!r}; allowed: {list(TAGS)}")
    return tags


class MemorySaver:
    """Memory release state of one ModelRunner.

    Args:
        model_runner: provides ``model``, ``device``, ``token_to_kv_pool`` and ``graphs``
            (``DeviceGraphs``: released and resumed through it).
        cpu_backup: keep the weights on the CPU while released (``--enable-weights-cpu-backup``).
        use_torch_memory_saver: allocate through ``torch-memory-saver`` (CUDA only; ignored
            with a warning when the package is missing).
    """

    def __init__(
        self, model_runner: Any, cpu_backup: bool = False, use_torch_memory_saver: bool = False
    ):
        self.runner = model_runner
        self.cpu_backup = cpu_backup
        self.released: set[str] = set()
        self.missing: set[str] = set()
        self._weights: dict[str, tuple[torch.nn.Parameter, torch.Size, torch.Tensor | None]] = {}
        self._kv_shapes: list[torch.Size] = []
        self.tms = None
        if use_torch_memory_saver and torch.device(model_runner.device).type == "cuda":
            self.tms = _torch_memory_saver()
            if self.tms is None:
                logger.warning(
                    "--enable-memory-saver: torch-memory-saver is not installed; release frees and reallocates"
                )
            else:
                self.tms.hook_mode = "torch"

    def region(self, tag: str):
        """Context in which allocations belong to ``tag`` (a no-op without torch-memory-saver)."""
        if self.tms is None:
            return contextlib.nullcontext()
        return self.tms.region(tag=tag, enable_cpu_backup=self.cpu_backup and tag == "weights")

    # ---- state --------------------------------------------------------------------------------

    def blocked_reason(self) -> str | None:
        """Why the runner cannot serve now, or None."""
        if self.released:
            return (
                f"memory is released (tags {sorted(self.released)}); "
                "POST /resume_memory_occupation before generating"
            )
        if self.missing:
            return (
                f"weights were released without a CPU backup: {len(self.missing)} tensors still need a weight "
                "update (update_weights_from_disk, _from_tensor or _from_distributed)"
            )
        return None

    def note_loaded(self, names: Iterable[str] | None) -> None:
        """A weight update wrote ``names`` (None: every tensor, e.g. a disk update)."""
        if names is None:
            self.missing.clear()
        else:
            self.missing.difference_update(names)

    # ---- release / resume ---------------------------------------------------------------------

    def release(self, tags: Iterable[str] | None) -> str:
        """Free the memory of ``tags``; returns what was done.

        Raises:
            MemorySaverError: unknown tag.
        """
        tags = [t for t in check_tags(tags) if t not in self.released]
        runner = self.runner
        on_gpu = torch.device(runner.device).type == "cuda"
        # Graphs read fixed addresses: drop them whenever their inputs may move.
        if "cuda_graph" in tags or (self.tms is None and tags):
            runner.graphs.release()
        if "weights" in tags:
            self._release_weights()
        if "kv_cache" in tags:
            self._release_kv()
        self.released.update(tags)
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        else:
            _malloc_trim()
        return f"released {sorted(tags)}" if tags else "nothing to release"

    def resume(self, tags: Iterable[str] | None) -> str:
        """Allocate the memory of ``tags`` again; returns what was done (and what is missing)."""
        tags = [t for t in check_tags(tags) if t in self.released]
        if "weights" in tags:
            self._resume_weights()
        if "kv_cache" in tags:
            self._resume_kv()
        self.released.difference_update(tags)
        if not self.released.intersection(TAGS):
            self.runner.graphs.resume()
        note = (
            f"; {len(self.missing)} tensors need a weight update before serving"
            if self.missing
            else ""
        )
        return (f"resumed {sorted(tags)}" if tags else "nothing to resume") + note

    def _release_weights(self) -> None:
        model = self.runner.model
        from shardline_runtime.models.weight_loading import full_checkpoint_shapes

        names = full_checkpoint_shapes(model)
        if self.tms is not None:
            self.tms.pause("weights")
        else:
            for name, param in model.named_parameters():
                backup = None
                if self.cpu_backup:
                    backup = param.data if param.device.type == "cpu" else param.data.to("cpu")
                self._weights[name] = (param, param.shape, backup)
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        if not self.cpu_backup:
            self.missing = set(names)

    def _resume_weights(self) -> None:
        if self.tms is not None:
            self.tms.resume("weights")
            return
        for param, shape, backup in self._weights.values():
            if backup is not None:
                param.data = backup.to(param.device)
            else:
                param.data = torch.zeros(shape, dtype=param.dtype, device=param.device)
        self._weights.clear()

    def _release_kv(self) -> None:
        pool = self.runner.token_to_kv_pool
        if self.tms is not None:
            self.tms.pause("kv_cache")
            return
        self._kv_shapes = [b.shape for b in pool.k_buffer_head_major]
        empty = torch.empty(0, dtype=pool.dtype, device=pool.device)
        pool.k_buffer_head_major = [empty] * pool.num_layers
        pool.v_buffer_head_major = [empty] * pool.num_layers
        pool.k_buffer, pool.v_buffer = [], []

    def _resume_kv(self) -> None:
        pool = self.runner.token_to_kv_pool
        if self.tms is not None:
            self.tms.resume("kv_cache")
            return
        pool.k_buffer_head_major = [
            torch.zeros(s, dtype=pool.dtype, device=pool.device) for s in self._kv_shapes
        ]
        pool.v_buffer_head_major = [
            torch.zeros(s, dtype=pool.dtype, device=pool.device) for s in self._kv_shapes
        ]
        pool.k_buffer = [b.transpose(0, 1) for b in pool.k_buffer_head_major]
        pool.v_buffer = [b.transpose(0, 1) for b in pool.v_buffer_head_major]
