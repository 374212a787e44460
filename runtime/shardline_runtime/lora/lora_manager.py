"""LoRAManager: wraps the model's linear layers, owns the slot pool, loads/unloads PEFT adapters
and prepares each step's per-token adapter layout (after SGLang's ``LoRAManager`` /
``LoRAMemoryPool``).

Pool: ``max_loras_per_batch`` fixed slots per wrapped layer (allocated once at start-up, sized
for ``max_lora_rank``). A loaded adapter occupies one slot, so any batch fits the pool. Loading
into a full pool evicts the least recently used adapter no request is using, or fails with
:class:`LoRAPoolFullError` (HTTP 503). An evicted adapter is unloaded (it must be loaded again).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardline_runtime.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from shardline_runtime.lora.layers import (
    ColumnParallelLinearWithLoRA,
    LoRABatchInfo,
    RowParallelLinearWithLoRA,
    column_submodules,
)
from shardline_runtime.lora.lora_config import (
    LoRAAdapterError,
    LoRAConfig,
    LoRAPoolFullError,
    load_lora_tensors,
    parse_lora_paths,
    resolve_target_modules,
)

if TYPE_CHECKING:
    from shardline_runtime.server_args_sections import LoRAArgs

logger = logging.getLogger(__name__)


@dataclass
class LoadedAdapter:
    name: str
    path: str
    rank: int
    slot: int
    last_used: int


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class LoRAManager:
    """LoRA state of one TP rank's model.

    Args:
        model: the loaded model; its ``qkv_proj``/``gate_up_proj``/``o_proj``/``down_proj``
            layers whose HF modules are in ``target_modules`` are replaced by LoRA wrappers.
        max_loras_per_batch: pool slots (adapters loaded at once).
        max_lora_rank: largest rank an adapter may have.
        target_modules: HF module names LoRA may touch.
    """

    def __init__(
        self,
        model: nn.Module,
        max_loras_per_batch: int,
        max_lora_rank: int,
        target_modules: tuple[str, ...],
    ):
        self.max_loras_per_batch = max_loras_per_batch
        self.max_lora_rank = max_lora_rank
        self.target_modules = tuple(target_modules)
        self.batch_info = LoRABatchInfo()
        self.layers: dict[
            str, ColumnParallelLinearWithLoRA | RowParallelLinearWithLoRA
        ] = {}  # module path -> wrapper
        self.hf_names: dict[
            str, tuple[str, str]
        ] = {}  # HF module path -> (model module path, sub name)
        self.slots: list[str | None] = [None] * max_loras_per_batch
        self.adapters: dict[str, LoadedAdapter] = {}
        self._clock = itertools.count(1)
        self._wrap(model)
        self.device = next(model.parameters()).device
        # GPU: the Triton segment kernel; CPU (or no Triton): per-adapter groups. Tests set it on
        # CPU under TRITON_INTERPRET=1.
        self.segment_kernel = self.device.type == "cuda" and _triton_available()

    def _wrap(self, model: nn.Module) -> None:
        for path, module in list(model.named_modules()):
            own = path.rsplit(".", 1)[-1]
            if isinstance(module, RowParallelLinear):
                subs = [own]
            elif (
                isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear))
                or type(module) is ColumnParallelLinear
            ):
                subs = [s.name for s in column_submodules(module, own)]
            else:
                continue
            if not any(s in self.target_modules for s in subs):
                continue
            parent_path, _, attr = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            args = (own, self.max_loras_per_batch, self.max_lora_rank, self.batch_info)
            wrapper: ColumnParallelLinearWithLoRA | RowParallelLinearWithLoRA
            if isinstance(module, RowParallelLinear):
                wrapper = RowParallelLinearWithLoRA(module, *args)
            else:
                assert isinstance(module, ColumnParallelLinear)
                wrapper = ColumnParallelLinearWithLoRA(module, *args)
            setattr(parent, attr, wrapper)
            self.layers[path] = wrapper
            for s in subs:
                if s in self.target_modules:
                    self.hf_names[f"{parent_path}.{s}" if parent_path else s] = (path, s)
        if not self.layers:
            raise ValueError(
                f"--lora-target-modules {list(self.target_modules)} match no layer of this model"
            )

    # ---- adapters -----------------------------------------------------------------------------

    def load_adapter(
        self, name: str, path: str, in_use: AbstractSet[str] = frozenset()
    ) -> LoadedAdapter:
        """Validate ``path`` fully, then copy it into a free (or evicted) slot.

        Raises:
            LoRAAdapterError: a name already loaded, rank above ``max_lora_rank``, a missing or
                unreadable file, a module this server does not wrap, or shapes of another base.
            LoRAPoolFullError: every slot holds an adapter named in ``in_use``.
        """
        if name in self.adapters:
            raise LoRAAdapterError(
                f"lora_name {name!r} is already loaded (from {self.adapters[name].path!r})",
                "lora_name",
            )
        config = LoRAConfig.from_path(path)
        if config.r > self.max_lora_rank:
            raise LoRAAdapterError(
                f"lora_path {path!r}: rank r={config.r} exceeds --max-lora-rank {self.max_lora_rank}"
            )
        tensors = load_lora_tensors(config)
        per_layer: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for hf_name, ab in tensors.items():
            if hf_name not in self.hf_names:
                leaf = hf_name.rsplit(".", 1)[-1]
                if leaf not in self.target_modules:
                    raise LoRAAdapterError(
                        f"lora_path {path!r}: the adapter targets {leaf!r}, which this server does not wrap "
                        f"(--lora-target-modules {list(self.target_modules)})"
                    )
                raise LoRAAdapterError(
                    f"lora_path {path!r}: wrong base architecture: the model has no module {hf_name!r}"
                )
            layer_path, sub = self.hf_names[hf_name]
            per_layer.setdefault(layer_path, {})[sub] = ab
        for layer_path, wrapper in self.layers.items():  # every check before any slot changes
            wrapper.load_slot(
                0, per_layer.get(layer_path, {}), config.scaling, layer_path, check_only=True
            )
        slot = self._free_slot(in_use)
        for layer_path, wrapper in self.layers.items():
            wrapper.load_slot(slot, per_layer.get(layer_path, {}), config.scaling, layer_path)
        self.slots[slot] = name
        adapter = LoadedAdapter(name, path, config.r, slot, next(self._clock))
        self.adapters[name] = adapter
        logger.info(
            "LoRA adapter %r (r=%d) loaded from %s into slot %d", name, config.r, path, slot
        )
        return adapter

    def _free_slot(self, in_use: AbstractSet[str]) -> int:
        if None in self.slots:
            return self.slots.index(None)
        idle = [a for a in self.adapters.values() if a.name not in in_use]
        if not idle:
            raise LoRAPoolFullError(
                f"all {self.max_loras_per_batch} LoRA slots (--max-loras-per-batch) hold adapters in use; retry later"
            )
        victim = min(idle, key=lambda a: a.last_used)
        logger.info(
            "LoRA pool full: evicting unused adapter %r (in use: %s)", victim.name, sorted(in_use)
        )
        self.unload_adapter(victim.name)
        return victim.slot

    def unload_adapter(self, name: str) -> None:
        """Free ``name``'s slot. Raises LoRAAdapterError (``lora_name``) when it is not loaded."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoRAAdapterError(
                f"lora_name {name!r} is not loaded; loaded: {sorted(self.adapters)}", "lora_name"
            )
        for wrapper in self.layers.values():
            wrapper.clear_slot(adapter.slot)
        self.slots[adapter.slot] = None

    # ---- one step -----------------------------------------------------------------------------

    def prepare_lora_batch(
        self, lora_names: list[str | None] | None, tokens_per_req: list[int]
    ) -> None:
        """Set the shared ``batch_info`` for a step whose request ``i`` runs ``tokens_per_req[i]``
        packed tokens with adapter ``lora_names[i]`` (None: the base model).

        Raises:
            LoRAAdapterError: a name is not loaded (the scheduler admits only loaded ones).
        """
        info = self.batch_info
        info.groups, info.seg_slots, info.seg_starts, info.seg_lens, info.seg_tensors = (
            [],
            [],
            [],
            [],
            None,
        )
        info.row_layout, info.max_seg_len = None, 0
        if not lora_names or all(n is None for n in lora_names):
            return
        per_slot: dict[int, list[torch.Tensor]] = {}
        start = 0
        for name, n in zip(lora_names, tokens_per_req):
            if name is not None and n > 0:
                adapter = self.adapters.get(name)
                if adapter is None:
                    raise LoRAAdapterError(f"lora_name {name!r} is not loaded", "lora_name")
                adapter.last_used = next(self._clock)
                per_slot.setdefault(adapter.slot, []).append(torch.arange(start, start + n))
                info.seg_slots.append(adapter.slot)
                info.seg_starts.append(start)
                info.seg_lens.append(n)
            start += n
        info.max_seg_len = max(info.seg_lens, default=0)
        info.groups = [(slot, torch.cat(idx).to(self.device)) for slot, idx in per_slot.items()]
        if self.segment_kernel:
            starts, lens, slots = (
                torch.tensor(v, dtype=torch.int32, device=self.device)
                for v in (info.seg_starts, info.seg_lens, info.seg_slots)
            )
            info.seg_tensors = (starts, lens, slots)

    def row_slots(self, lora_names: list[str | None] | None, rows: int) -> list[int]:
        """The adapter slot of each of ``rows`` decode rows (-1: the base model), marking each
        named adapter used.

        Raises:
            LoRAAdapterError: a name is not loaded.
        """
        names = list(lora_names or [None] * rows)
        out = []
        for name in names:
            adapter = self.adapters.get(name) if name is not None else None
            if name is not None and adapter is None:
                raise LoRAAdapterError(f"lora_name {name!r} is not loaded", "lora_name")
            if adapter is not None:
                adapter.last_used = next(self._clock)
            out.append(adapter.slot if adapter is not None else -1)
        return out

    def bind_rows(self, starts: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor) -> None:
        """Make a decode graph's static (rows,) int32 buffers the step's layout: row ``t`` is
        segment ``t`` (``starts = arange``, ``lens`` 1 or 0, ``slots``), read by the segment
        kernel inside the graph (after SGLang's and vLLM's captured LoRA batches), or by the
        wrappers' per-row path without the kernel."""
        info = self.batch_info
        info.groups, info.seg_slots, info.seg_starts, info.seg_lens = [], [], [], []
        info.max_seg_len = 1
        info.seg_tensors = (starts, lens, slots) if self.segment_kernel else None
        info.row_layout = None if self.segment_kernel else (slots, lens)

    def loaded(self) -> list[dict]:
        """``[{"name", "path", "rank", "slot"}]`` of the loaded adapters."""
        return [
            {"name": a.name, "path": a.path, "rank": a.rank, "slot": a.slot}
            for a in self.adapters.values()
        ]


def build_lora_manager(model: nn.Module, lora: LoRAArgs) -> LoRAManager | None:
    """The ``LoRAManager`` for ``lora`` (``--lora-paths`` loaded), or None without
    ``--enable-lora``. ``max_lora_rank`` defaults to the largest start-up adapter's rank, else 16.

    Raises:
        LoRAAdapterError: a start-up adapter cannot be loaded, or the base model is quantized
            (the LoRA layers read the base weight in the model dtype).
    """
    if not lora.enable_lora:
        return None
    quantization = getattr(getattr(model, "config", None), "quantization", None)
    if quantization is not None:
        raise LoRAAdapterError(
            f"--enable-lora: LoRA on a quantized base model ({quantization.scheme}) is not "
            "supported; serve the unquantized checkpoint to use adapters"
        )
    paths = parse_lora_paths(list(lora.lora_paths))
    max_rank = lora.max_lora_rank or max(
        [LoRAConfig.from_path(p).r for p in paths.values()] or [16]
    )
    manager = LoRAManager(
        model,
        lora.max_loras_per_batch,
        max_rank,
        resolve_target_modules(list(lora.lora_target_modules)),
    )
    for name, path in paths.items():
        manager.load_adapter(name, path)
    return manager
