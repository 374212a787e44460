"""ModelConfig: the parsed ``config.json`` of a HuggingFace checkpoint directory.

Reads both spellings of RoPE settings: transformers 5.x writes ``rope_parameters`` (with
``rope_theta`` inside), older checkpoints write ``rope_scaling`` (with ``type`` or
``rope_type``) next to a top-level ``rope_theta``. Both are normalised into one
``rope_parameters`` dict the way ``transformers.modeling_rope_utils.standardize_rope_params``
does, and an unsupported RoPE type fails here, at startup, before any weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardline_runtime.configs.moe_config import checked_moe_fields, moe_parallel_problem
from shardline_runtime.configs.pooling_config import (
    PoolingConfig,
    PoolingConfigError,
    read_pooling_config,
)
from shardline_runtime.layers.quantization.base import QuantizationConfig, QuantizationError
from shardline_runtime.layers.quantization.online_fp8 import requested_quantization
from shardline_runtime.layers.quantization.registry import quantization_config_from

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# Keys each RoPE type needs (besides rope_type and rope_theta), as transformers validates them.
_ROPE_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto",) + tuple(_DTYPES)


# Fields that must be equal for new weights to replace live ones: they change what weights of the
# same shapes mean, or how the model runs. One list for both checks: the header-only validation
# of a checkpoint (model_loader/validate.py) and the in-place update (weight_update.py).
MUST_MATCH_FIELDS = (
    "architecture",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "sliding_windows",
    "max_position_embeddings",
    "context_len",
    "num_experts",
    "num_experts_per_tok",
    "norm_topk_prob",
    "moe_layers",
    "quantization",
    "pooling",
)


def first_mismatch(old: ModelConfig, new: ModelConfig) -> tuple[str, Any, Any] | None:
    """The first of ``MUST_MATCH_FIELDS`` that differs, as ``(field, old value, new value)``."""
    for name in MUST_MATCH_FIELDS:
        old_value, new_value = getattr(old, name), getattr(new, name)
        if old_value != new_value:
            return name, old_value, new_value
    return None


class ModelConfigError(ValueError):
    """config.json is unusable, or it cannot run at the asked TP size; the message names the field."""


def _require(cfg: dict, key: str, path: Path) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ModelConfigError(f"{path}: config.json lacks required field {key!r}")
    return cfg[key]


def parse_rope_parameters(cfg: dict, source: str = "config.json") -> dict[str, Any]:
    """Normalise RoPE settings into ``{"rope_type", "rope_theta", ...type-specific keys}``.

    Raises:
        ModelConfigError: unknown ``rope_type`` (lists the supported ones), a required key of
            the type is missing, or ``partial_rotary_factor`` != 1 (not supported).
    """
    raw = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(raw, dict):
        raise ModelConfigError(
            f"{source}: rope_parameters/rope_scaling must be an object, got {raw!r}"
        )
    params = dict(raw)
    rope_type = params.pop("type", None)
    rope_type = params.get("rope_type") or rope_type or "default"
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(
            f"{source}: unsupported RoPE type {rope_type!r} in rope_parameters/rope_scaling; "
            f"supported types: {', '.join(ROPE_TYPES)}"
        )
    params["rope_type"] = rope_type
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ModelConfigError(
            f"{source}: partial_rotary_factor {partial} is not supported (only 1.0)"
        )
    if rope_type in ("llama3", "yarn"):
        params.setdefault(
            "original_max_position_embeddings",
            cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings")),
        )
    missing = [k for k in _ROPE_REQUIRED[rope_type] if params.get(k) is None]
    if missing:
        raise ModelConfigError(
            f"{source}: RoPE type {rope_type!r} needs {missing} in rope_parameters/rope_scaling"
        )
    return params


def resolve_dtype(requested: str, config_dtype: str | None, device_type: str) -> torch.dtype:
    """``auto`` -> the checkpoint's dtype (float32 on CPU for half types); else the named dtype.

    Raises:
        ModelConfigError: ``requested`` is not one of ``DTYPE_CHOICES``.
    """
    if requested not in DTYPE_CHOICES:
        raise ModelConfigError(f"dtype must be one of {DTYPE_CHOICES}, got {requested!r}")
    if requested != "auto":
        return _DTYPES[requested]
    dtype = _DTYPES.get(str(config_dtype or "float32").replace("torch.", ""), torch.float32)
    if device_type == "cpu" and dtype != torch.float32:
        return torch.float32
    return dtype


@dataclass(frozen=True)
class ModelConfig:
    """What the runtime needs from ``config.json``; build with :meth:`from_pretrained`.

    ``head_dim`` is per attention head; ``context_len`` is the longest request in tokens
    (``context_length`` override or ``max_position_embeddings``); ``sliding_windows`` holds one
    window (tokens, or None for full attention) per layer.
    """

    model_path: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    context_len: int
    dtype: torch.dtype
    rope_parameters: dict[str, Any]
    # config.json's biases; a model file may override them (Qwen2: models/qwen2.py)
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    # mixture of experts (configs/moe_config.py); num_experts == 0 for dense models
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    sliding_windows: tuple[int | None, ...] = ()
    # the checkpoint's quantization_config (layers/quantization/); None: unquantized
    quantization: QuantizationConfig | None = None
    # an embedding model's pooling (sentence-transformers files); None: a generation model
    pooling: PoolingConfig | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def is_generation(self) -> bool:
        """SGLang's flag: False for an embedding model (sentence-transformers files)."""
        return self.pooling is None

    @property
    def sliding_window_size(self) -> int | None:
        """Tokens a windowed attention layer sees (the largest window when layers differ), or
        None when no layer has a sliding window."""
        windows = [w for w in self.sliding_windows if w is not None]
        return max(windows) if windows else None

    @classmethod
    def from_pretrained(
        cls,
        model_path: str | Path,
        dtype: str = "auto",
        context_length: int | None = None,
        device_type: str = "cpu",
        quantization: str = "auto",
    ) -> ModelConfig:
        """Read ``<model_path>/config.json``; ``quantization`` is ``--quantization`` (``auto``:
        the checkpoint's ``quantization_config``; ``fp8``: online FP8 of a bf16 checkpoint).

        Raises:
            ModelConfigError: missing file/field, unsupported architecture or RoPE type.
        """
        path = Path(model_path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelConfigError(
                f"{path}: no config.json (is --model-path a HuggingFace checkpoint directory?)"
            )
        try:
            cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{cfg_file}: not valid JSON: {e}") from None
        try:
            pooling = read_pooling_config(path, cfg, int(_require(cfg, "hidden_size", path)))
        except PoolingConfigError as e:
            raise ModelConfigError(str(e)) from None
        return cls.from_dict(
            cfg,
            str(path),
            dtype=dtype,
            context_length=context_length,
            device_type=device_type,
            quantization=quantization,
            pooling=pooling,
        )

    @classmethod
    def from_dict(
        cls,
        cfg: dict,
        model_path: str = "",
        dtype: str = "auto",
        context_length: int | None = None,
        device_type: str = "cpu",
        quantization: str = "auto",
        pooling: PoolingConfig | None = None,
    ) -> ModelConfig:
        """Same as :meth:`from_pretrained` from an already parsed ``config.json`` dict
        (``pooling``: the embedding model's, read from the directory by ``from_pretrained``)."""
        # the model classes declare their architecture's rules (models/registry.py lists them)
        from shardline_runtime.models.registry import MODEL_REGISTRY, causal_class_for

        path = Path(model_path)
        archs = cfg.get("architectures") or []
        model_cls = causal_class_for(archs[0], embedding=pooling is not None) if archs else None
        if model_cls is None:
            raise ModelConfigError(
                f"{path}: architectures[0] is {archs[0] if archs else None!r}; supported: {', '.join(MODEL_REGISTRY)}"
                + (" (embedding models: also their *Model base architectures)" if pooling else "")
            )
        arch = archs[0]
        hidden = int(_require(cfg, "hidden_size", path))
        heads = int(_require(cfg, "num_attention_heads", path))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads != 0:
            raise ModelConfigError(
                f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        layers = int(_require(cfg, "num_hidden_layers", path))
        max_pos = int(cfg.get("max_position_embeddings") or 2048)
        if context_length is not None and context_length < 1:
            raise ModelConfigError(f"context_length must be >= 1, got {context_length}")
        try:
            moe = checked_moe_fields(model_cls.moe_fields(cfg, layers), arch, path)
        except ValueError as e:
            raise ModelConfigError(str(e)) from None
        try:
            source = str(path / "config.json")
            served = requested_quantization(
                quantization, quantization_config_from(cfg, source), source
            )
        except QuantizationError as e:
            raise ModelConfigError(str(e)) from None
        if pooling is not None and moe.get("num_experts"):
            raise ModelConfigError(
                f"{path / 'modules.json'}: an embedding model of a mixture-of-experts architecture "
                f"({arch}) is not supported; supported: dense architectures"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"{path}: hidden_act {act!r} is not supported (only 'silu')")
        return cls(
            model_path=str(path),
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(_require(cfg, "intermediate_size", path)),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=int(_require(cfg, "vocab_size", path)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=max_pos,
            context_len=context_length or max_pos,
            dtype=resolve_dtype(dtype, cfg.get("dtype") or cfg.get("torch_dtype"), device_type),
            rope_parameters=parse_rope_parameters(cfg, f"{path / 'config.json'}"),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=act,
            sliding_windows=model_cls.sliding_windows(cfg, layers),
            quantization=served,
            pooling=pooling,
            hf_config=cfg,
            **moe,
        )

    def get_num_kv_heads(self, tp_size: int) -> int:
        """KV heads per rank: ``num_key_value_heads / tp_size``, at least 1 (replicated)."""
        return max(1, self.num_key_value_heads // tp_size)

    def valid_tp_sizes(self, limit: int = 64) -> list[int]:
        """TP sizes up to ``limit`` this model can be split over."""
        return [t for t in range(1, limit + 1) if self._tp_problem(t) is None]

    def _tp_problem(self, tp_size: int) -> str | None:
        if self.num_attention_heads % tp_size:
            return f"num_attention_heads {self.num_attention_heads} is not divisible by tp_size {tp_size}"
        kv = self.num_key_value_heads
        if kv >= tp_size and kv % tp_size:
            return f"num_key_value_heads {kv} is not divisible by tp_size {tp_size}"
        if kv < tp_size and tp_size % kv:
            return f"tp_size {tp_size} is not a multiple of num_key_value_heads {kv} (KV heads cannot be replicated evenly)"
        if self.intermediate_size % tp_size:
            return (
                f"intermediate_size {self.intermediate_size} is not divisible by tp_size {tp_size}"
            )
        if self.shared_expert_intermediate_size % tp_size:
            return f"shared_expert_intermediate_size {self.shared_expert_intermediate_size} is not divisible by tp_size {tp_size}"
        return None

    def check_ep_size(self, tp_size: int, ep_size: int, num_redundant_experts: int = 0) -> None:
        """Refuse an expert-parallel layout the experts cannot be split over (dense models
        accept only ``ep_size == 1``).

        Raises:
            ModelConfigError: names ``ep_size`` and the reason.
        """
        if not self.num_experts:
            if ep_size != 1 or num_redundant_experts:
                raise ModelConfigError(
                    f"{self.model_path}: ep_size {ep_size} and ep_num_redundant_experts "
                    f"{num_redundant_experts} need a mixture-of-experts model; {self.architecture} has no experts"
                )
            return
        problem = moe_parallel_problem(
            self.num_experts, self.moe_intermediate_size, tp_size, ep_size, num_redundant_experts
        )
        if problem:
            raise ModelConfigError(
                f"{self.model_path}: cannot run at tp_size {tp_size}, ep_size {ep_size}: {problem}"
            )

    def check_tp_size(self, tp_size: int) -> None:
        """Refuse a TP size the heads cannot be split over.

        Raises:
            ModelConfigError: names the reason and lists the valid TP sizes.
        """
        if tp_size < 1:
            raise ModelConfigError(f"tp_size must be >= 1, got {tp_size}")
        problem = self._tp_problem(tp_size)
        if problem:
            valid = self.valid_tp_sizes(max(self.num_attention_heads, tp_size))
            raise ModelConfigError(
                f"{self.model_path}: cannot run at tp_size {tp_size}: {problem}; valid tp sizes: {valid}"
            )


def qwen_sliding_windows(cfg: dict, layers: int) -> tuple[int | None, ...]:
    """Qwen2/Qwen3 (and their MoE): ``sliding_window`` on the layers ``layer_types`` marks
    ``sliding_attention`` (else layers from ``max_window_layers`` on), with ``use_sliding_window``."""
    if not cfg.get("use_sliding_window", False):
        return (None,) * layers
    types = cfg.get("layer_types") or [
        "sliding_attention" if i >= cfg.get("max_window_layers", layers) else "full_attention"
        for i in range(layers)
    ]
    return tuple(cfg.get("sliding_window") if t == "sliding_attention" else None for t in types)


def every_layer_sliding_window(cfg: dict, layers: int) -> tuple[int | None, ...]:
    """Mistral/Mixtral: ``sliding_window`` (None: full attention) on every layer."""
    return (cfg.get("sliding_window"),) * layers
