"""Llama decoder-only transformer (Touvron et al. 2023), tensor-parallel.

Design: pre-norm blocks ``x + attn(norm(x))``, ``x + mlp(norm(x))`` with the residual add fused
into the next RMSNorm (as SGLang); fused QKV and gate/up projections (column-parallel) feeding
row-parallel output projections, so each block does exactly two all-reduces (in ``o_proj`` and
``down_proj``). Parameter names follow the HuggingFace checkpoint, with ``q/k/v_proj`` stacked
into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj`` at load time. Qwen2, Qwen3 and
Mistral reuse these blocks (see their modules). This file never imports ``torch.distributed``.

Pipeline parallelism: the model is built for one :class:`PipelineStage` (default: the whole
model). It creates the decoder layers of its range only (the others are :class:`PPMissingLayer`,
so ``model.layers.<i>`` keeps its global index and checkpoint name), the embedding on the first
stage and the final norm and LM head on the last. A stage that is not the last returns
:class:`PPProxyTensors`; one that is not the first starts from the ones it is given. The stage
is handed in by the ModelRunner; the model never asks ``torch.distributed`` for its rank.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from shardline_runtime.configs.model_config import ModelConfig
from shardline_runtime.configs.pipeline_stage import PipelineStage
from shardline_runtime.layers.activation import SiluAndMul
from shardline_runtime.layers.layernorm import RMSNorm
from shardline_runtime.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from shardline_runtime.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from shardline_runtime.layers.radix_attention import RadixAttention
from shardline_runtime.layers.rotary_embedding import get_rope
from shardline_runtime.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from shardline_runtime.model_executor.forward_batch_info import PPProxyTensors
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


class PPMissingLayer(nn.Module):
    """Placeholder for a module another pipeline stage owns: no parameters, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module belongs to another pipeline stage")


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm; with a ``stage``, only those it owns."""

    layer_cls = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, layer_cls: type[LlamaDecoderLayer] | None = None,
                 stage: PipelineStage | None = None):
        super().__init__()
        layer_cls = layer_cls or self.layer_cls
        stage = stage or PipelineStage()
        n = config.num_hidden_layers
        self.start_layer, self.end_layer = stage.start_layer, stage.end(n)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if stage.is_first else PPMissingLayer()
        self.layers = nn.ModuleList([
            layer_cls(config, i) if self.start_layer <= i < self.end_layer else PPMissingLayer() for i in range(n)
        ])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last else PPMissingLayer()


class LlamaForCausalLM(nn.Module):
    """Causal LM: ``forward(input_ids, positions, forward_batch) -> LogitsProcessorOutput``.

    With ``tie_word_embeddings`` the LM head *is* the embedding module (one parameter), and a
    stored ``lm_head.weight`` is ignored, as transformers does. When the first and last pipeline
    stages differ, the last stage has its own LM head and loads the embedding's weights into it.
    """

    layer_cls = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, stage: PipelineStage | None = None):
        super().__init__()
        self.config = config
        self.stage = stage or PipelineStage()
        self.model = LlamaModel(config, self.layer_cls, self.stage)
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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch,
                input_embeds: torch.Tensor | None = None,
                pp_proxy_tensors: PPProxyTensors | None = None) -> LogitsProcessorOutput | PPProxyTensors | None:
        """Runs this stage's layers, or ``[split_forward_start_layer, split_forward_end_layer)``
        of them; returns None when a split range stops before the stage's last layer (states kept
        on the batch), :class:`PPProxyTensors` on a stage that is not the last, else the logits.
        ``input_embeds`` (T, hidden_size), when given, replaces the token embedding (first stage);
        ``pp_proxy_tensors`` are the previous stage's output (every other stage)."""
        first, last = self.model.start_layer, self.model.end_layer
        start = forward_batch.split_forward_start_layer if forward_batch.split_forward_start_layer is not None else first
        end = forward_batch.split_forward_end_layer if forward_batch.split_forward_end_layer is not None else last
        if start == 0:
            hidden_states = self.model.embed_tokens(input_ids) if input_embeds is None else input_embeds  # (T, hidden)
            residual = None
        elif start == first and pp_proxy_tensors is not None:
            hidden_states, residual = pp_proxy_tensors["hidden_states"], pp_proxy_tensors["residual"]
        else:
            hidden_states, residual = forward_batch.split_hidden_states, forward_batch.split_residual
        for layer in self.model.layers[start:end]:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        if end < last:
            forward_batch.split_hidden_states, forward_batch.split_residual = hidden_states, residual
            return None
        if not self.stage.is_last:
            return PPProxyTensors({"hidden_states": hidden_states, "residual": residual})  # (T, hidden) each
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
        head_is_embedding = self.config.tie_word_embeddings and self.stage.is_first
        return names + (("lm_head.weight",) if head_is_embedding else ())

    def stage_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
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
        load_named_weights(self, self.stage_weights(weights), self.stacked_params_mapping, self.ignored_checkpoint_names())
