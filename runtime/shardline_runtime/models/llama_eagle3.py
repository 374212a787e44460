"""The EAGLE-3 draft head of a Llama-family target (``LlamaForCausalLMEagle3``; Li et al. 2025,
"EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test").

The head reads three of the target's intermediate states instead of its last one, and predicts
over its own reduced vocabulary. At draft position ``p`` (token ``x[p + 1]`` in, the feature
``g[p]`` of token ``x[p]``)::

    g = fc(concat(a_1, a_2, a_3))        # (T, 3 * hidden) -> (T, hidden): the target's states
                                         # after its aux layers; skipped when g is already
                                         # (T, hidden) (the head's own previous f_hat)
    x = concat(input_layernorm(embed(x[p + 1])), hidden_norm(g))    # (T, 2 * hidden)
    h = g + self_attn(x)                 # q/k/v_proj take 2 * hidden
    f_hat = h + mlp(post_attention_layernorm(h))                    # fed back while drafting
    logits = lm_head(norm(f_hat))        # (T, draft_vocab_size)
    target_id = draft_id + d2t[draft_id]

Checkpoint (the public format as SGLang's ``llama_eagle3.py`` loads it, e.g.
``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``): ``config.json`` a Llama config with ``architectures:
["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``, the target's ``vocab_size``,
``draft_vocab_size`` and optionally ``eagle_config.eagle_aux_hidden_state_layer_ids``; tensors
``fc.weight`` (hidden, 3 * hidden) (``fc.bias`` when ``"bias": true``), ``midlayer.*`` (one
Llama block with ``hidden_norm``; ``q/k/v_proj`` (out, 2 * hidden)), ``norm.weight``,
``lm_head.weight`` (draft_vocab_size, hidden), ``d2t`` (draft_vocab_size,) int64 and ``t2d``
(vocab_size,) bool (not needed to draft; skipped). The token embedding is the target's
(:meth:`set_embed_and_head`); a stored ``embed_tokens.weight`` is ignored. Which target layers
feed it is the worker's business (``speculative/eagle3_worker.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from shardline_runtime.configs.model_config import ModelConfig
from shardline_runtime.configs.pipeline_stage import PipelineStage
from shardline_runtime.layers.layernorm import RMSNorm
from shardline_runtime.layers.linear import ColumnParallelLinear, QKVParallelLinear, _check_shape
from shardline_runtime.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from shardline_runtime.layers.parameter import set_weight_attrs
from shardline_runtime.layers.vocab_parallel_embedding import ParallelLMHead
from shardline_runtime.models.llama import LlamaDecoderLayer
from shardline_runtime.models.llama_eagle import LlamaForCausalLMEagle

AUX_LAYERS = 3  # target states fused by fc


def draft_vocab_size(config: ModelConfig) -> int:
    """``config.json``'s ``draft_vocab_size`` (the head's LM-head rows).

    Raises:
        ValueError: missing, or not in [1, vocab_size] (names the field).
    """
    value = config.hf_config.get("draft_vocab_size")
    if not isinstance(value, int) or not 1 <= value <= config.vocab_size:
        raise ValueError(
            f"{config.model_path}: config.json draft_vocab_size must be an integer in "
            f"[1, vocab_size {config.vocab_size}], got {value!r}"
        )
    return value


class Eagle3DecoderLayer(LlamaDecoderLayer):
    """The head's one block: attention over ``[norm(embedding), norm(feature)]`` (2 * hidden)."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, 0)
        attn = self.self_attn
        attn.qkv_proj = QKVParallelLinear(
            2 * config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=attn.qkv_bias(config),
            prefix="model.midlayer.self_attn.qkv_proj",
        )
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, embeds, features, forward_batch):  # type: ignore[override]
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(features)), dim=-1)
        x = self.self_attn(positions, x, forward_batch)
        x, residual = self.post_attention_layernorm(x, features)
        return self.mlp(x), residual


class Eagle3Model(nn.Module):
    """``fc``, the block and the final norm: embeddings (T, hidden) and features (T, 3 * hidden)
    or (T, hidden) -> (normed (T, hidden), pre-norm f_hat (T, hidden))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h = config.hidden_size
        bias = bool(config.hf_config.get("bias", False))
        self.fc = ColumnParallelLinear(
            AUX_LAYERS * h, h, bias=bias, gather_output=True, prefix="model.fc"
        )
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, embeds, features, positions, forward_batch):
        features = features.to(embeds.dtype)
        if features.shape[-1] != embeds.shape[-1]:
            features = self.fc(features)
        hidden, residual = self.midlayer(positions, embeds, features, forward_batch)
        return self.norm(hidden, residual)


class LlamaForCausalLMEagle3(LlamaForCausalLMEagle):
    """EAGLE-3 head: ``forward(input_ids, positions, forward_batch) -> LogitsProcessorOutput``
    with ``next_token_logits`` over the draft vocabulary (module docstring); map argmax ids
    with :meth:`draft_to_target`. Call :meth:`set_embed_and_head` first (only the embedding is
    used).

    Raises:
        ValueError: (construction) ``draft_vocab_size`` missing or out of range; (forward)
            ``forward_batch.spec_hidden_states`` is not (T, 3 * hidden) or (T, hidden).
    """

    architecture: ClassVar[str] = "LlamaForCausalLMEagle3"
    head_name: ClassVar[str] = "EAGLE-3"

    def __init__(self, config: ModelConfig, stage: PipelineStage | None = None):
        nn.Module.__init__(self)
        self.config = config
        self.stage = stage or PipelineStage()
        self.draft_vocab_size = draft_vocab_size(config)
        self.model = Eagle3Model(config)  # type: ignore[assignment]  # not a LlamaModel
        self.lm_head = ParallelLMHead(self.draft_vocab_size, config.hidden_size)
        # draft id -> target id offset; int64, loaded whole on every rank
        self.d2t = nn.Parameter(
            torch.zeros(self.draft_vocab_size, dtype=torch.int64), requires_grad=False
        )
        set_weight_attrs(self.d2t, self._load_d2t, {None: (self.draft_vocab_size,)})
        self.logits_processor = LogitsProcessor(self.draft_vocab_size)
        self.shared: tuple[nn.Module, nn.Module] | None = None

    @staticmethod
    def _load_d2t(param: nn.Parameter, loaded: torch.Tensor) -> None:
        _check_shape(loaded, tuple(param.shape), "d2t")
        param.data.copy_(loaded)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids (any shape, int64) -> target ids: ``ids + d2t[ids]``."""
        return ids + self.d2t[ids]

    def feature_sizes(self) -> tuple[int, ...]:
        """The widths ``spec_hidden_states`` may have: the target's fused states, or f_hat."""
        h = self.config.hidden_size
        return (AUX_LAYERS * h, h)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch,
        input_embeds: torch.Tensor | None = None,
        pp_proxy_tensors=None,
    ) -> LogitsProcessorOutput:
        features = self.spec_features(forward_batch, input_ids.shape[0])
        embeds = self.get_input_embeddings()(input_ids) if input_embeds is None else input_embeds
        normed, f_hat = self.model(embeds, features, positions, forward_batch)
        out = self.logits_processor(input_ids, normed, self.lm_head, forward_batch)
        if out.hidden_states is not None:
            out.hidden_states = f_hat  # the pre-norm state is what the next step reads
        return out

    def ignored_checkpoint_names(self) -> tuple[str, ...]:
        """``t2d`` (target -> draft membership), a stored embedding, RoPE tables."""
        return ("t2d", "embed_tokens.weight", "rotary_emb.inv_freq")

    def stage_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """Checkpoint names (``fc.*``, ``midlayer.*``, ``norm.*``) -> this module's (``model.``
        prefix); ``lm_head.weight`` and ``d2t`` as they are."""
        for name, tensor in weights:
            if name.startswith("model.") or name.startswith("lm_head.") or name == "d2t":
                yield name, tensor
            else:
                yield "model." + name, tensor
