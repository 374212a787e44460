"""Llama decoder-only transformer (Touvron et al. 2023), tensor-parallel.

Design: pre-norm blocks ``x + attn(norm(x))``, ``x + mlp(norm(x))`` with the residual add fused
into the next RMSNorm (as SGLang); fused QKV and gate/up projections (column-parallel) feeding
row-parallel output projections, so each block does exactly two all-reduces (in ``o_proj`` and
``down_proj``). Parameter names follow the HuggingFace checkpoint, with ``q/k/v_proj`` stacked
into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj`` at load time. Qwen2, Qwen3 and
Mistral reuse these blocks (see their modules). This file never imports ``torch.distributed``.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from shardline_runtime.configs.model_config import ModelConfig
from shardline_runtime.layers.activation import SiluAndMul
from shardline_runtime.layers.layernorm import RMSNorm
from shardline_runtime.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from shardline_runtime.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from shardline_runtime.layers.radix_attention import RadixAttention
from shardline_runtime.layers.rotary_embedding import get_rope
from shardline_runtime.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from shardline_runtime.models.weight_loading import load_named_weights


class LlamaMLP(nn.Module):
    """SwiGLU MLP of ``intermediate_size`` (default: the config's); ``reduce_results=False``
    returns this rank's partial sum (a MoE shared expert adds it to the experts' before one
    all-reduce)."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None, reduce_results: bool = True):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=config.mlp_bias, reduce_results=reduce_results)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # (T, hidden), all-reduced unless asked


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads,
            bias=config.qkv_bias,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim, config.hidden_size, bias=config.o_proj_bias
        )
        self.rotary_emb = get_rope(  # one table shared by every layer
            config.head_dim, config.rope_parameters, config.max_position_embeddings,
            max_positions=max(config.context_len, config.max_position_embeddings) + 8,
        )
        window = config.sliding_windows[layer_id] if config.sliding_windows else None
        self.attn = RadixAttention(
            self.num_heads, config.head_dim, config.head_dim ** -0.5, self.num_kv_heads, layer_id, sliding_window=window
        )

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook for per-head q/k normalisation (Qwen3); identity for Llama."""
        return q, k

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # (T, q_size + 2 * kv_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)  # (T, H_kv, D)
        q, k = self.norm_qk(q, k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v.contiguous(), forward_batch)
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
        return LlamaMLP(config)

    def forward(self, positions, hidden_states, forward_batch, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, layer_cls: type[LlamaDecoderLayer] | None = None):
        super().__init__()
        layer_cls = layer_cls or self.layer_cls
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([layer_cls(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Causal LM: ``forward(input_ids, positions, forward_batch) -> LogitsProcessorOutput``.

    With ``tie_word_embeddings`` the LM head *is* the embedding module (one parameter), and a
    stored ``lm_head.weight`` is ignored, as transformers does.
    """

    layer_cls = LlamaDecoderLayer

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.layer_cls)
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def get_input_embeddings(self) -> nn.Module:
        """The token embedding: (T,) int64 ids -> (T, hidden_size)."""
        return self.model.embed_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch,
                input_embeds: torch.Tensor | None = None) -> LogitsProcessorOutput | None:
        """Runs layers ``[split_forward_start_layer, split_forward_end_layer)`` (all by default);
        returns None when the range stops before the last layer (states kept on the batch).
        ``input_embeds`` (T, hidden_size), when given, replaces the token embedding."""
        n = len(self.model.layers)
        start = forward_batch.split_forward_start_layer or 0
        end = forward_batch.split_forward_end_layer if forward_batch.split_forward_end_layer is not None else n
        if start == 0:
            hidden_states = self.model.embed_tokens(input_ids) if input_embeds is None else input_embeds  # (T, hidden)
            residual = None
        else:
            hidden_states, residual = forward_batch.split_hidden_states, forward_batch.split_residual
        for layer in self.model.layers[start:end]:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        if end < n:
            forward_batch.split_hidden_states, forward_batch.split_residual = hidden_states, residual
            return None
        if residual is None:
            hidden_states = self.model.norm(hidden_states)
        else:
            hidden_states, _ = self.model.norm(hidden_states, residual)
        return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch)

    # Checkpoint name fragment -> (stacked parameter fragment, shard id).
    stacked_params_mapping = (
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    )

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Name -> full (unsharded) shape of every tensor a checkpoint of ``config`` must hold."""
        h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
        q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            })
            if config.qkv_bias:
                shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                               p + "self_attn.v_proj.bias": (kv,)})
            if config.o_proj_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            if config.mlp_bias:
                shapes.update({p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,),
                               p + "mlp.down_proj.bias": (h,)})
            if config.qk_norm:
                shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        shapes["model.norm.weight"] = (h,)
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (config.vocab_size, h)
        return shapes

    def ignored_checkpoint_names(self) -> tuple[str, ...]:
        """Checkpoint names that are not parameters (skipped silently)."""
        names = ("rotary_emb.inv_freq", ".k_scale", ".v_scale")  # KV scales: model_executor/kv_cache_dtype.py
        return names + (("lm_head.weight",) if self.config.tie_word_embeddings else ())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full checkpoint tensors; each parameter takes its TP shard.

        Raises:
            CheckpointError: unexpected, duplicate or missing parameter, or wrong shape (named).
        """
        load_named_weights(self, weights, self.stacked_params_mapping, self.ignored_checkpoint_names())
