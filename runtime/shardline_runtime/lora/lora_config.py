"""A PEFT LoRA adapter on disk: ``adapter_config.json`` + ``adapter_model.safetensors``.

``LoRAConfig.from_path`` reads and checks the config; ``load_lora_tensors`` reads the weights
and groups them per target module. Every user-caused problem is a :class:`LoRAAdapterError`
(HTTP 400) naming the field. Format and scaling (``lora_alpha / r``, or ``lora_alpha /
sqrt(r)`` with ``use_rslora``) follow PEFT's ``LoraConfig`` / ``LoraLayer``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# HF module names a LoRA may target in the dense decoder blocks Shardline serves.
SUPPORTED_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<ab>lora_A|lora_B)(?:\.[^.]+)?\.weight$")


class LoRAAdapterError(ValueError):
    """The adapter cannot be served (missing file, wrong base model, rank too high...); HTTP 400.
    ``param`` names the request field or flag at fault."""

    def __init__(self, message: str, param: str = "lora_path"):
        super().__init__(message)
        self.param = param


class LoRAPoolFullError(RuntimeError):
    """Every slot of the pool holds an adapter some request is using; HTTP 503."""


@dataclass(frozen=True)
class LoRAConfig:
    """The fields of ``adapter_config.json`` serving needs.

    Attributes:
        path: the adapter directory.
        r: the rank; ``lora_alpha``: the PEFT alpha; ``scaling``: the factor applied to ``B A x``.
        target_modules: HF leaf module names (``q_proj``...).
    """

    path: str
    r: int
    lora_alpha: float
    scaling: float
    target_modules: tuple[str, ...]

    @classmethod
    def from_path(cls, path: str) -> LoRAConfig:
        """Read ``path/adapter_config.json``.

        Raises:
            LoRAAdapterError: the file is missing or not JSON, not a LoRA adapter, or uses a PEFT
                feature serving does not apply (bias, DoRA, modules_to_save, rank/alpha patterns).
        """
        cfg_file = os.path.join(path, "adapter_config.json")
        if not os.path.isfile(cfg_file):
            raise LoRAAdapterError(f"lora_path {path!r}: adapter_config.json not found")
        try:
            with open(cfg_file, encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise LoRAAdapterError(
                f"lora_path {path!r}: adapter_config.json is not valid JSON ({e})"
            ) from None
        if cfg.get("peft_type", "LORA") != "LORA":
            raise LoRAAdapterError(
                f"lora_path {path!r}: peft_type is {cfg.get('peft_type')!r}; only 'LORA' is served"
            )
        for field, bad in (
            ("bias", lambda v: v not in (None, "none")),
            ("use_dora", bool),
            ("modules_to_save", bool),
            ("rank_pattern", bool),
            ("alpha_pattern", bool),
        ):
            if bad(cfg.get(field)):
                raise LoRAAdapterError(
                    f"lora_path {path!r}: adapter_config.json field {field}={cfg.get(field)!r} is not supported"
                )
        r = cfg.get("r")
        if not isinstance(r, int) or r < 1:
            raise LoRAAdapterError(
                f"lora_path {path!r}: adapter_config.json field r must be a positive integer, got {r!r}"
            )
        alpha = float(cfg.get("lora_alpha", r))
        scaling = alpha / (r**0.5) if cfg.get("use_rslora") else alpha / r
        targets = cfg.get("target_modules") or []
        if isinstance(targets, str):  # PEFT allows a regex; resolved from the weights below
            targets = []
        return cls(path=path, r=r, lora_alpha=alpha, scaling=scaling, target_modules=tuple(targets))


def load_lora_tensors(config: LoRAConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{hf_module_name: (A (r, in), B (out, r))}`` from ``adapter_model.safetensors``
    (``hf_module_name`` like ``model.layers.0.self_attn.q_proj``), float32 on CPU.

    Raises:
        LoRAAdapterError: the file is missing/unreadable, a key is not a LoRA A/B weight of a
            supported module, or a module lacks its A or B.
    """
    from safetensors.torch import load_file

    file = os.path.join(config.path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise LoRAAdapterError(f"lora_path {config.path!r}: adapter_model.safetensors not found")
    try:
        raw = load_file(file)
    except Exception as e:  # safetensors raises several types for a corrupt file
        raise LoRAAdapterError(
            f"lora_path {config.path!r}: cannot read adapter_model.safetensors ({e})"
        ) from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAAdapterError(
                f"lora_path {config.path!r}: unexpected tensor {key!r} (only lora_A/lora_B weights are served)"
            )
        module = m.group("module")
        if module.rsplit(".", 1)[-1] not in SUPPORTED_TARGET_MODULES:
            raise LoRAAdapterError(
                f"lora_path {config.path!r}: target module {module!r} is not supported; allowed: {list(SUPPORTED_TARGET_MODULES)}"
            )
        pairs.setdefault(module, {})[m.group("ab")] = tensor.float()
    out = {}
    for module, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoRAAdapterError(
                f"lora_path {config.path!r}: module {module!r} has {sorted(ab)}, needs lora_A and lora_B"
            )
        out[module] = (ab["lora_A"], ab["lora_B"])
    return out


def parse_lora_paths(items: list[str] | None) -> dict[str, str]:
    """``["name=path", "path"]`` -> ``{name: path}`` (a bare path is named by itself).

    Raises:
        ValueError: an empty name/path or a repeated name (names ``--lora-paths``).
    """
    out: dict[str, str] = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = item, item
        if not name or not path:
            raise ValueError(f"--lora-paths entry {item!r} must be NAME=PATH")
        if name in out:
            raise ValueError(f"--lora-paths names {name!r} twice")
        out[name] = path
    return out


def resolve_target_modules(requested: list[str] | None) -> tuple[str, ...]:
    """``--lora-target-modules`` -> HF module names (``all`` or empty: every supported one).

    Raises:
        ValueError: an unknown name (lists the allowed ones).
    """
    if not requested or "all" in requested:
        return SUPPORTED_TARGET_MODULES
    bad = [m for m in requested if m not in SUPPORTED_TARGET_MODULES]
    if bad:
        raise ValueError(
            f"--lora-target-modules {bad} unknown; allowed: {list(SUPPORTED_TARGET_MODULES)} or 'all'"
        )
    return tuple(requested)
