"""The sparse mixture-of-experts block shared by the MoE models, and their checkpoint naming.

``SparseMoeBlock(x)`` = ``experts(x, top-k of gate(x))`` (+ ``sigmoid(shared_expert_gate(x)) *
shared_expert(x)`` for Qwen2-MoE), as transformers' ``Qwen2MoeSparseMoeBlock``. Both the
experts and the shared expert return this rank's partial sums and the block combines them
with one collective (visible here, in ``forward``), instead of one per branch.
"""

from __future__ import annotations

import torch
from torch import nn

from shardline_runtime.configs.model_config import ModelConfig
from shardline_runtime.distributed import expert_parallel_combine
from shardline_runtime.layers.moe.expert_params import DEFAULT_EXPERT_NAMES
from shardline_runtime.layers.moe.fused_moe import FusedMoE
from shardline_runtime.layers.moe.router import ReplicatedLinear, TopKRouter
from shardline_runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from shardline_runtime.models.weight_loading import load_named_weights


class SparseMoeBlock(nn.Module):
    """(T, hidden) -> (T, hidden), combined over the group."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        prefix: str = "",
        expert_names: dict[str, str] = DEFAULT_EXPERT_NAMES,
    ):
        super().__init__()
        self.gate = TopKRouter(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.norm_topk_prob,
        )
        self.experts = FusedMoE(
            config.num_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            layer_id,
            reduce_results=False,
            quant_config=config.quantization,
            prefix=f"{prefix}.experts",
            expert_names=expert_names,
        )
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(
                config,
                config.shared_expert_intermediate_size,
                reduce_results=False,
                prefix=f"model.layers.{layer_id}.mlp.shared_expert",
            )
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        _, topk_weights, topk_ids = self.gate(hidden_states)  # (T, k), (T, k)
        out = self.experts(hidden_states, topk_weights, topk_ids)  # (T, hidden) partial
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(
                self.shared_expert_gate(hidden_states)
            )  # (T, 1), same on every rank
            out = out + gate * self.shared_expert(
                hidden_states
            )  # gate is per token, so it commutes with the sum
        return expert_parallel_combine(out)


class MoeDecoderLayer(LlamaDecoderLayer):
    """A decoder layer whose MLP is a :class:`SparseMoeBlock` where ``config.moe_layers`` says;
    the checkpoint names the block ``moe_block_name`` and one expert's projections
    ``expert_names`` (w1 gate, w2 down, w3 up), which choose the experts' quantization."""

    moe_block_name = "mlp"
    expert_names = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}

    def build_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        prefix = f"model.layers.{layer_id}.{self.moe_block_name}"
        return (
            SparseMoeBlock(config, layer_id, prefix, self.expert_names)
            if config.moe_layers[layer_id]
            else LlamaMLP(config, prefix=f"model.layers.{layer_id}.mlp")
        )


class MoeForCausalLM(LlamaForCausalLM):
    """Base of the MoE causal LMs. Subclasses name the checkpoint's expert tensors with
    ``expert_names`` (w1 gate, w2 down, w3 up) and, when it differs from ``mlp``, the
    checkpoint's block name (``moe_block_name``)."""

    layer_cls = MoeDecoderLayer
    moe_block_name = MoeDecoderLayer.moe_block_name
    expert_names = MoeDecoderLayer.expert_names

    def expert_params_mapping(self) -> list[tuple[str, str, int, str]]:
        """``(checkpoint fragment, parameter fragment, expert_id, shard_id)`` for every expert."""
        rows = []
        for e in range(self.config.num_experts):
            for shard_id, name in self.expert_names.items():
                fused = ".experts.w2_" if shard_id == "w2" else ".experts.w13_"
                rows.append((f".experts.{e}.{name}.", fused, e, shard_id))
        return rows

    def to_checkpoint_name(self, name: str) -> str:
        """The checkpoint spells the block ``moe_block_name`` (Mixtral: every layer is sparse)."""
        return (
            name.replace(".mlp.", f".{self.moe_block_name}.")
            if self.moe_block_name != "mlp"
            else name
        )

    def load_weights(self, weights) -> None:
        """Load full checkpoint tensors; experts go through ``FusedMoE.weight_loader``.

        Raises:
            CheckpointError: unexpected, duplicate or missing parameter or expert, or wrong shape.
        """
        block = f".{self.moe_block_name}."
        weights = self.stage_weights(weights)
        if block != ".mlp.":
            weights = ((name.replace(block, ".mlp."), t) for name, t in weights)
        load_named_weights(
            self,
            weights,
            self.stacked_params_mapping,
            self.ignored_checkpoint_names(),
            self.expert_params_mapping(),
        )
