"""Model classes by ``config.json`` ``architectures[0]``: each class declares its
``architecture`` name and its rules for ``config.json`` (``sliding_windows``, ``moe_fields``), so
registering an architecture is its model file plus one line of :data:`MODELS`."""

from __future__ import annotations

from shardline_runtime.configs.model_config import ModelConfigError
from shardline_runtime.models.llama import LlamaForCausalLM
from shardline_runtime.models.mistral import MistralForCausalLM
from shardline_runtime.models.mixtral import MixtralForCausalLM
from shardline_runtime.models.qwen2 import Qwen2ForCausalLM
from shardline_runtime.models.qwen2_moe import Qwen2MoeForCausalLM
from shardline_runtime.models.qwen3 import Qwen3ForCausalLM
from shardline_runtime.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS: tuple[type[LlamaForCausalLM], ...] = (
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    MistralForCausalLM,
    Qwen3MoeForCausalLM,
    Qwen2MoeForCausalLM,
    MixtralForCausalLM,
)
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {m.architecture: m for m in MODELS}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The model class of ``architecture``.

    Raises:
        ModelConfigError: unknown architecture (lists the supported ones).
    """
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ModelConfigError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(MODEL_REGISTRY)}"
        ) from None
