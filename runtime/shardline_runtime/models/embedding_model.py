"""EmbeddingModel: a decoder of a registered architecture, read out by a pooler, no LM head.

Design choice: decoder embedding models (Qwen3-Embedding, E5-Mistral, GTE-Qwen2) are the
causal LMs Shardline already serves with their LM head replaced by pooling, so they run through
the same ModelRunner, paged KV cache, attention backends and TP layers; only the read-out
differs. (A BERT-style encoder would need bidirectional attention, absolute position and token
type embeddings and LayerNorm/GELU blocks: a second model family beside the paged causal path.)

``forward`` returns :class:`EmbeddingPoolerOutput` (one partial per request and step, see
``layers/pooler.py``) instead of logits. Checkpoint names: sentence-transformers saves the base
model (``embed_tokens.weight``, ``layers.0...``; Qwen3-Embedding ships this spelling under a
``Qwen3ForCausalLM`` config), fine-tuning tools often keep the ``model.`` prefix; both load,
and a stored ``lm_head.weight`` is ignored. ``to_checkpoint_name`` gives the unprefixed
spelling (what an in-place weight update checks a new checkpoint against). Pipeline parallelism
is refused (the pooled vectors would have to travel back from the last stage).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from shardline_runtime.configs.model_config import ModelConfig, ModelConfigError
from shardline_runtime.configs.pipeline_stage import PipelineStage
from shardline_runtime.layers.pooler import EmbeddingPoolerOutput, Pooler
from shardline_runtime.model_executor.forward_batch_info import PPProxyTensors
from shardline_runtime.models.llama import LlamaForCausalLM, LlamaModel
from shardline_runtime.models.registry import causal_class_for


class EmbeddingModel(LlamaForCausalLM):
    """``forward(input_ids, positions, forward_batch) -> EmbeddingPoolerOutput``.

    Args:
        config: a config with ``pooling`` set (``ModelConfig.is_generation`` False).
        stage: must be the whole model.

    Raises:
        ModelConfigError: no pooling, an unknown architecture, or a pipeline stage.
    """

    def __init__(self, config: ModelConfig, stage: PipelineStage | None = None):
        nn.Module.__init__(self)
        causal = causal_class_for(config.architecture, embedding=True)
        if config.pooling is None or causal is None:
            raise ModelConfigError(
                f"{config.model_path}: not an embedding model of a supported architecture "
                f"({config.architecture}); it needs sentence-transformers' modules.json"
            )
        self.config = config
        self.stage = stage or PipelineStage()
        if not (self.stage.is_first and self.stage.is_last):
            raise ModelConfigError(
                f"{config.model_path}: embedding models do not run with pp_size > 1; use tensor "
                "parallelism (--tp-size)"
            )
        self.layer_cls = causal.layer_cls
        self.model = LlamaModel(config, causal.layer_cls, self.stage)
        self.pooler = Pooler(config.pooling.pooling_type)

    def forward(  # type: ignore[override]  # pooled vectors instead of logits
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch,
        input_embeds: torch.Tensor | None = None,
        pp_proxy_tensors: PPProxyTensors | None = None,
    ) -> EmbeddingPoolerOutput:
        """Every layer, the final norm, then this step's pooled partial per request."""
        hidden_states = self.model(input_ids, positions, forward_batch, input_embeds)
        assert isinstance(hidden_states, torch.Tensor)  # one stage: the normed (T, hidden)
        return self.pooler(hidden_states, forward_batch)

    def forward_split_prefill(self, *args, **kwargs):
        """Refused: layer-range prefill is a generation feature.

        Raises:
            ValueError: always, naming the forward mode.
        """
        raise ValueError("forward_mode SPLIT_PREFILL is not served by embedding models")

    def to_checkpoint_name(self, name: str) -> str:
        """The sentence-transformers spelling: the base model's names, no ``model.`` prefix."""
        return name.removeprefix("model.")

    def ignored_checkpoint_names(self) -> tuple[str, ...]:
        return (*super().ignored_checkpoint_names(), "lm_head.weight")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a base-model (unprefixed) or causal-LM (``model.``-prefixed) checkpoint.

        Raises:
            CheckpointError: unexpected, duplicate or missing parameter, or wrong shape (named).
        """
        named = (
            (name if name.startswith(("model.", "lm_head.")) else f"model.{name}", tensor)
            for name, tensor in weights
        )
        super().load_weights(named)
