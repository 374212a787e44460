"""Llama decoder-only transformer (Touvron et al. 2023), tensor-parallel.

Design: pre-norm blocks ``x + attn(norm(x))``, ``x + mlp(norm(x))`` with the residual add fused
into the next RMSNorm (as SGLang); fused QKV and gate/up projections (column-parallel) feeding
row-parallel output projections, so each block does exactly two all-reduces (in ``o_proj`` and
``down_proj``). Parameter names follow the HuggingFace checkpoint, with ``q/k/v_proj`` stacked
into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj`` at load time. Qwen2, Qwen3 and
Mistral reuse these blocks; what makes each family different (biases, q/k norm) is declared in
its own model file by overriding the hooks of :class:`LlamaAttention`. The checkpoint's expected
tensors and shapes are read from the built module (``weight_loading.checkpoint_shapes``). This
file never imports ``torch.distributed``.

Pipeline parallelism: the model is built for one :class:`PipelineStage` (default: the whole
model). It creates the decoder layers of its range only (the others are :class:`PPMissingLayer`,
so ``model.layers.<i>`` keeps its global index and checkpoint name), the embedding on the first
stage and the final norm and LM head on the last. A stage that is not the last returns
:class:`PPProxyTensors`; one that is not the first starts from the ones it is given. The stage
is handed in by the ModelRunner; the model never asks ``torch.distributed`` for its rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from shardline_runtime.configs.model_config import ModelConfig
from shardline_runtime.configs.pipeline_stage import PipelineStage
from shardline_runtime.layers.activation import SiluAndMul
from shardline_runtime.layers.layernorm import RMSNorm
from shardline_runtime.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from shardline_runtime.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from shardline_runtime.layers.radix_attention import RadixAttention
from shardline_runtime.layers.rotary_embedding import get_rope
from shardline_runtime.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from shardline_runtime.model_executor.forward_batch_info import PPProxyTensors
from shardline_runtime.models.weight_loading import load_named_weights


class LlamaMLP(nn.Module):
    """SwiGLU MLP of ``intermediate_size`` (default: the config's); ``reduce_results=False``
    returns this rank's partial sum (a MoE shared expert adds it to the experts' before one
    all-reduce). ``prefix`` is its checkpoint module name (``model.layers.0.mlp``), which the
    checkpoint's quantization config matches."""

    def __init__(
        self,
        config: ModelConfig,
        intermediate_size: int | None = None,
        reduce_results: bool = True,
        prefix: str = "",
    ):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        quant = config.quantization
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [inter, inter],
            bias=config.mlp_bias,
            quant_config=quant,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            inter,
            config.hidden_size,
            bias=config.mlp_bias,
            reduce_results=reduce_results,
            quant_config=quant,
            prefix=f"{prefix}.down_proj",
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(
            self.act_fn(self.gate_up_proj(x))
        )  # (T, hidden), all-reduced unless asked


class LlamaAttention(nn.Module):
    """Grouped-query attention with RoPE. A model family states how it differs here:

    - ``qk_norm`` (class attribute): RMSNorm over each head of q and k (weight of size
      ``head_dim``, parameters ``q_norm`` / ``k_norm``) before RoPE (Qwen3).
    - :meth:`qkv_bias` / :meth:`o_proj_bias`: whether the projections carry biases (Llama and
      Mistral: ``config.json``'s ``attention_bias``; Qwen2: always on q/k/v, never on o).
    """

    qk_norm: ClassVar[bool] = False

    @classmethod
    def qkv_bias(cls, config: ModelConfig) -> bool:
        return config.attention_bias

    @classmethod
    def o_proj_bias(cls, config: ModelConfig) -> bool:
        return config.attention_bias

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=self.qkv_bias(config),
            quant_config=config.quantization,
            prefix=f"model.layers.{layer_id}.self_attn.qkv_proj",
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            bias=self.o_proj_bias(config),
            quant_config=config.quantization,
            prefix=f"model.layers.{layer_id}.self_attn.o_proj",
        )
        self.q_norm = self.k_norm = None
        if self.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.rotary_emb = get_rope(  # one table shared by every layer
            config.head_dim,
            config.rope_parameters,
            config.max_position_embeddings,
            max_positions=max(config.context_len, config.max_position_embeddings) + 8,
        )
        window = config.sliding_windows[layer_id] if config.sliding_windows else None
        self.attn = RadixAttention(
            self.num_heads,
            config.head_dim,
            config.head_dim**-0.5,
            self.num_kv_heads,
            layer_id,
            sliding_window=window,
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # (T, q_size + 2 * kv_size)
        q, k, v = qkv.split_with_sizes([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)  # (T, H_kv, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head
        # rotary is applied by the attention layer: with the KV store in one kernel on CUDA
        out = self.attn(q, k, v, forward_batch, positions=positions, rotary_emb=self.rotary_emb)
        return self.o_proj(out)  # (T, hidden), all-reduced


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_id)
        self.mlp = self.build_mlp(config, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def build_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        """The feed-forward block of layer ``layer_id`` (a sparse MoE block in MoE models)."""
        return LlamaMLP(config, prefix=f"model.layers.{layer_id}.mlp")

    def forward(self, positions, hidden_states, forward_batch, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class PPMissingLayer(nn.Module):
    """Placeholder for a module another pipeline stage owns: no parameters, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module belongs to another pipeline stage")


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm: (T,) token ids -> (T, hidden_size) hidden states;
    with a ``stage``, only the parts it owns (see the module docstring)."""

    layer_cls = LlamaDecoderLayer

    def __init__(
        self,
        config: ModelConfig,
        layer_cls: type[LlamaDecoderLayer] | None = None,
        stage: PipelineStage | None = None,
    ):
        super().__init__()
        layer_cls = layer_cls or self.layer_cls
        stage = stage or PipelineStage()
        n = config.num_hidden_layers
        self.start_layer, self.end_layer = stage.start_layer, stage.end(n)
        self.is_first, self.is_last = stage.is_first, stage.is_last
        self.embed_tokens: nn.Module = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size)
            if stage.is_first
            else PPMissingLayer()
        )
        self.layers = nn.ModuleList(
            [
                layer_cls(config, i) if self.start_layer <= i < self.end_layer else PPMissingLayer()
                for i in range(n)
            ]
        )
        self.norm = (
            RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last else PPMissingLayer()
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch,
        input_embeds: torch.Tensor | None = None,
        pp_proxy_tensors: PPProxyTensors | None = None,
    ) -> torch.Tensor | PPProxyTensors:
        """This stage's layers (all of them without pipeline parallelism). The first stage
        embeds ``input_ids`` (or takes ``input_embeds`` (T, hidden_size)); the others start from
        the previous stage's ``pp_proxy_tensors``. Returns the normed (T, hidden_size) states on
        the last stage, else :class:`PPProxyTensors` (``hidden_states`` and ``residual``)."""
        hidden_states, residual = self.stage_input(input_ids, input_embeds, pp_proxy_tensors)
        hidden_states, residual = self.forward_layers(
            self.start_layer, self.end_layer, positions, hidden_states, residual, forward_batch
        )
        return self.stage_output(hidden_states, residual)

    def stage_input(
        self,
        input_ids: torch.Tensor,
        input_embeds: torch.Tensor | None,
        pp_proxy_tensors: PPProxyTensors | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(hidden_states, residual)`` (T, hidden_size) this stage starts from: the embedding
        of ``input_ids`` (or ``input_embeds``) on the first stage, with no residual yet; the
        previous stage's ``pp_proxy_tensors`` on the others."""
        if self.is_first:
            hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
            return hidden, None
        assert pp_proxy_tensors is not None, (
            "a pipeline stage after the first needs the previous stage's tensors"
        )
        return pp_proxy_tensors["hidden_states"], pp_proxy_tensors["residual"]

    def stage_output(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | PPProxyTensors:
        """After this stage's last layer: the normed (T, hidden_size) states on the last stage,
        else :class:`PPProxyTensors` for the next stage."""
        if not self.is_last:
            assert residual is not None  # a stage runs at least one layer
            return PPProxyTensors({"hidden_states": hidden_states, "residual": residual})
        return self.final_norm(hidden_states, residual)

    def forward_layers(
        self,
        start: int,
        end: int,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        forward_batch,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers ``[start, end)`` on (T, hidden) states and the residual carried between them
        (None before the first layer)."""
        for layer in self.layers[start:end]:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        return hidden_states, residual

    def final_norm(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor:
        if residual is None:
            return self.norm(hidden_states)
        return self.norm(hidden_states, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Causal LM: ``forward(input_ids, positions, forward_batch) -> LogitsProcessorOutput``.

    With ``tie_word_embeddings`` the LM head *is* the embedding module (one parameter), and a
    stored ``lm_head.weight`` is ignored, as transformers does. When the first and last pipeline
    stages differ, the last stage has its own LM head and loads the embedding's weights into it.
    """

    layer_cls = LlamaDecoderLayer
    architecture: ClassVar[str] = "LlamaForCausalLM"  # config.json architectures[0]

    @classmethod
    def sliding_windows(cls, cfg: dict, layers: int) -> tuple[int | None, ...]:
        """``ModelConfig.sliding_windows`` from ``config.json`` ``cfg``: one window (tokens) or
        None per layer. Llama: full attention everywhere."""
        return (None,) * layers

    @classmethod
    def moe_fields(cls, cfg: dict, layers: int) -> dict[str, Any]:
        """The MoE fields of ``ModelConfig`` in this architecture's spelling
        (``configs/moe_config.py``); empty for a dense model."""
        return {}

    def __init__(self, config: ModelConfig, stage: PipelineStage | None = None):
        super().__init__()
        self.config = config
        self.stage = stage or PipelineStage()
        self.model = LlamaModel(config, self.layer_cls, self.stage)
        self.lm_head: nn.Module
        if not self.stage.is_last:
            self.lm_head = PPMissingLayer()
        elif config.tie_word_embeddings and self.stage.is_first:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def get_input_embeddings(self) -> nn.Module:
        """The token embedding: (T,) int64 ids -> (T, hidden_size)."""
        return self.model.embed_tokens

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch,
        input_embeds: torch.Tensor | None = None,
        pp_proxy_tensors: PPProxyTensors | None = None,
    ) -> LogitsProcessorOutput | PPProxyTensors:
        """This stage's layers, then the logits on the last stage (:class:`PPProxyTensors` on the
        others). ``input_embeds`` (T, hidden_size), when given, replaces the token embedding
        (first stage); ``pp_proxy_tensors`` are the previous stage's output (every other stage)."""
        out = self.model(input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors)
        if isinstance(out, PPProxyTensors):
            return out
        return self.logits_processor(input_ids, out, self.lm_head, forward_batch)

    def forward_split_prefill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch,
        input_embeds: torch.Tensor | None = None,
        pp_proxy_tensors: PPProxyTensors | None = None,
    ) -> LogitsProcessorOutput | PPProxyTensors | None:
        """Layers ``[split_forward_start_layer, split_forward_end_layer)`` of a SPLIT_PREFILL
        step (SGLang's ``forward_split_prefill``), within this stage's range: hidden states and
        residual are carried in ``forward_batch.split_hidden_states`` / ``split_residual`` between
        calls; the call that reaches the stage's last layer returns the logits (last stage) or
        :class:`PPProxyTensors`, earlier calls None."""
        first, last = self.model.start_layer, self.model.end_layer
        start = (
            forward_batch.split_forward_start_layer
            if forward_batch.split_forward_start_layer is not None
            else first
        )
        end = (
            forward_batch.split_forward_end_layer
            if forward_batch.split_forward_end_layer is not None
            else last
        )
        if start == first:
            hidden_states, residual = self.model.stage_input(
                input_ids, input_embeds, pp_proxy_tensors
            )
        else:
            hidden_states, residual = (
                forward_batch.split_hidden_states,
                forward_batch.split_residual,
            )
        hidden_states, residual = self.model.forward_layers(
            start, end, positions, hidden_states, residual, forward_batch
        )
        if end < last:
            forward_batch.split_hidden_states, forward_batch.split_residual = (
                hidden_states,
                residual,
            )
            return None
        out = self.model.stage_output(hidden_states, residual)
        if isinstance(out, PPProxyTensors):
            return out
        return self.logits_processor(input_ids, out, self.lm_head, forward_batch)

    # Checkpoint name fragment -> (stacked parameter fragment, shard id).
    stacked_params_mapping = (
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    )

    def expert_params_mapping(self) -> list[tuple[str, str, int, str]]:
        """``(checkpoint fragment, parameter fragment, expert_id, shard_id)`` rows; none here."""
        return []

    def to_checkpoint_name(self, name: str) -> str:
        """Checkpoint spelling of a (split) parameter name; the same here."""
        return name

    def ignored_checkpoint_names(self) -> tuple[str, ...]:
        """Checkpoint names that are not parameters (skipped silently)."""
        names = (
            "rotary_emb.inv_freq",
            ".k_scale",
            ".v_scale",
        )  # KV scales: model_executor/kv_cache_dtype.py
        head_is_embedding = self.config.tie_word_embeddings and self.stage.is_first
        return names + (("lm_head.weight",) if head_is_embedding else ())

    def stage_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint tensors this pipeline stage holds: its layers, the embedding on the
        first stage, the norm and LM head on the last (a tied last stage that is not the first
        takes the embedding as ``lm_head.weight``). Everything passes without a pipeline."""
        stage, tied_head = self.stage, self.config.tie_word_embeddings and not self.stage.is_first
        for name, tensor in weights:
            if name.startswith("model.layers."):
                if self.model.start_layer <= int(name.split(".")[2]) < self.model.end_layer:
                    yield name, tensor
            elif name.startswith("model.embed_tokens."):
                if stage.is_first:
                    yield name, tensor
                if stage.is_last and tied_head:
                    yield name.replace("model.embed_tokens.", "lm_head."), tensor
            elif name.startswith(("model.norm.", "lm_head.")):
                if stage.is_last and not (tied_head and name.startswith("lm_head.")):
                    yield name, tensor
            else:
                yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full checkpoint tensors of this stage; each parameter takes its TP shard.

        Raises:
            CheckpointError: unexpected, duplicate or missing parameter, or wrong shape (named).
        """
        load_named_weights(
            self,
            self.stage_weights(weights),
            self.stacked_params_mapping,
            self.ignored_checkpoint_names(),
        )
