"""Model classes by ``config.json`` ``architectures[0]``."""

from __future__ import annotations

from shardline_runtime.configs.model_config import ModelConfigError
from shardline_runtime.models.llama import LlamaForCausalLM
from shardline_runtime.models.mistral import MistralForCausalLM
from shardline_runtime.models.mixtral import MixtralForCausalLM
from shardline_runtime.models.qwen2 import Qwen2ForCausalLM
from shardline_runtime.models.qwen2_moe import Qwen2MoeForCausalLM
from shardline_runtime.models.qwen3 import Qwen3ForCausalLM
from shardline_runtime.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


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
