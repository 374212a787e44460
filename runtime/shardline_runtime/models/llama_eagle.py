"""The EAGLE draft head of a Llama-family target (``LlamaForCausalLMEagle``; Li et al. 2024,
"EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty").

At draft position ``p`` the head reads the embedding of token ``x[p + 1]`` and the feature
``f[p]`` (the target's last hidden state after token ``x[p]``, after the final norm, or the
head's own prediction of it while drafting), and predicts the next feature::

    h = fc(concat(embed(x[p + 1]), f[p]))          # (T, 2 * hidden) -> (T, hidden), with bias
    h = decoder_layers(h)                          # layer 0 has no input RMSNorm
    f_hat = h + residual                           # no final norm
    logits = lm_head(f_hat)                        # the target's LM head

The embedding and LM head are the target's (:meth:`set_embed_and_head`, not parameters of this
module): the public EAGLE checkpoints (``fc.weight``, ``fc.bias``, ``layers.0.*``; SGLang's
``lmsys/sglang-EAGLE-*`` spelling with ``architectures: ["LlamaForCausalLMEagle"]``) train the
head against the frozen target embedding, and a stored ``embed_tokens.weight`` or
``lm_head.weight`` is ignored. The layout follows the EAGLE repository's ``cnets.py`` and SGLang's
``llama_eagle.py``. The step's features come in ``forward_batch.spec_hidden_states``
(T, hidden) and ``f_hat`` goes out in ``LogitsProcessorOutput.hidden_states`` when
``forward_batch.capture_hidden_states`` (the drafter feeds it back at the next position).
"""

from __future__ import annotations

from typing import ClassVar, cast

import torch
from torch import nn

from shardline_runtime.configs.model_config import ModelConfig
from shardline_runtime.configs.pipeline_stage import PipelineStage
from shardline_runtime.layers.linear import ColumnParallelLinear
from shardline_runtime.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from shardline_runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class EagleDecoderLayer(LlamaDecoderLayer):
    """A Llama block; layer 0 skips its input RMSNorm (its input is ``fc``'s output)."""

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__(config, layer_id)
        self.layer_id = layer_id
        if layer_id == 0:
            del self.input_layernorm

    def forward(self, positions, hidden_states, forward_batch, residual):
        if self.layer_id != 0:
            return super().forward(positions, hidden_states, forward_batch, residual)
        residual = hidden_states if residual is None else hidden_states + residual
        hidden_states = self.self_attn(positions, residual, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class EagleModel(nn.Module):
    """``fc`` and the decoder layers: (T,) embeddings + (T, hidden) features -> (T, hidden)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h = config.hidden_size
        self.fc = ColumnParallelLinear(2 * h, h, bias=True, gather_output=True, prefix="model.fc")
        self.layers = nn.ModuleList(
            [EagleDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )

    def forward(self, embeds, features, positions, forward_batch) -> torch.Tensor:
        hidden_states = self.fc(torch.cat((embeds, features.to(embeds.dtype)), dim=-1))
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        return hidden_states + residual


class LlamaForCausalLMEagle(LlamaForCausalLM):
    """EAGLE head: ``forward(input_ids, positions, forward_batch) -> LogitsProcessorOutput``
    (module docstring). Call :meth:`set_embed_and_head` with the target's modules before the
    first forward.

    Raises (forward):
        ValueError: ``forward_batch.spec_hidden_states`` is missing or not (T, hidden_size).
    """

    architecture: ClassVar[str] = "LlamaForCausalLMEagle"
    head_name: ClassVar[str] = "EAGLE"  # in error messages
    # reads forward_batch.spec_hidden_states: a decode graph keeps them in a static buffer
    takes_spec_features: ClassVar[bool] = True

    def __init__(self, config: ModelConfig, stage: PipelineStage | None = None):
        nn.Module.__init__(self)
        self.config = config
        self.stage = stage or PipelineStage()
        self.model = EagleModel(config)  # type: ignore[assignment]  # not a LlamaModel
        self.logits_processor = LogitsProcessor(config.vocab_size)
        # the target's (embedding, LM head); a tuple so they are not this module's parameters
        self.shared: tuple[nn.Module, nn.Module] | None = None

    @property
    def fc_weight(self) -> torch.Tensor:
        """``fc``'s weight (this rank's shard): the dtype and device features are given in."""
        return cast(EagleModel, self.model).fc.weight

    def set_embed_and_head(self, embed: nn.Module, head: nn.Module) -> None:
        """Use the target's token embedding and LM head (shared, never copied)."""
        self.shared = (embed, head)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Head vocabulary ids -> target ids: the same (the head uses the target's LM head)."""
        return ids

    def feature_sizes(self) -> tuple[int, ...]:
        """The widths ``spec_hidden_states`` may have: the target's last hidden state."""
        return (self.config.hidden_size,)

    def spec_features(self, forward_batch, tokens: int) -> torch.Tensor:
        """``forward_batch.spec_hidden_states``: (``tokens``, one of :meth:`feature_sizes`).

        Raises:
            ValueError: missing, or of another shape (names the field, the shapes allowed and
                the one given).
        """
        features = forward_batch.spec_hidden_states
        sizes = self.feature_sizes()
        if (
            features is None
            or features.dim() != 2
            or features.shape[0] != tokens
            or features.shape[1] not in sizes
        ):
            got = None if features is None else tuple(features.shape)
            width = sizes[0] if len(sizes) == 1 else f"one of {sizes}"
            raise ValueError(
                f"{self.head_name} head: spec_hidden_states must be ({tokens}, {width}), got {got}"
            )
        return features

    def get_input_embeddings(self) -> nn.Module:
        """The target's token embedding (after :meth:`set_embed_and_head`)."""
        if self.shared is None:
            raise RuntimeError("EAGLE head: set_embed_and_head was not called")
        return self.shared[0]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch,
        input_embeds: torch.Tensor | None = None,
        pp_proxy_tensors=None,
    ) -> LogitsProcessorOutput:
        features = self.spec_features(forward_batch, input_ids.shape[0])
        embed = self.get_input_embeddings()
        assert self.shared is not None
        embeds = embed(input_ids) if input_embeds is None else input_embeds
        f_hat = self.model(embeds, features, positions, forward_batch)
        return self.logits_processor(input_ids, f_hat, self.shared[1], forward_batch)

    def ignored_checkpoint_names(self) -> tuple[str, ...]:
        """The target's tensors some EAGLE checkpoints also store, and KV scales."""
        return ("embed_tokens.weight", "lm_head.weight", "rotary_emb.inv_freq")

    def to_checkpoint_name(self, name: str) -> str:
        """``model.fc.weight`` -> ``fc.weight`` (EAGLE checkpoints have no ``model.`` prefix)."""
        return name.removeprefix("model.")

    def stage_weights(self, weights):
        """Checkpoint names (``fc.*``, ``layers.*``) -> this module's (``model.`` prefix);
        ``LlamaForCausalLM.load_weights`` loads them."""
        for name, tensor in weights:
            yield (name if name.startswith("model.") else "model." + name), tensor
