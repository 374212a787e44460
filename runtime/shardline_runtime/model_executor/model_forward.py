"""The eager forward of one step of a ModelRunner (every step no graph replays): LoRA batch
preparation, attention metadata, caller-given input embeddings, the model (or its layer-range
``forward_split_prefill``), and the EPLB pass counter."""

from __future__ import annotations

from typing import Any

import torch

from shardline_runtime.layers.logits_processor import LogitsProcessorOutput
from shardline_runtime.model_executor.forward_batch_info import ForwardBatch, PPProxyTensors


def forward_eager(
    runner: Any, forward_batch: ForwardBatch, pp_proxy_tensors: PPProxyTensors | None = None
) -> LogitsProcessorOutput | PPProxyTensors | None:
    """Run ``forward_batch`` through ``runner``'s model eagerly (any ``ForwardMode``).

    Args:
        runner: the ``ModelRunner`` (``model``, ``attn_backend``, ``lora_manager``,
            ``eplb_manager``, ``pipeline_stage``, ``device``).
        pp_proxy_tensors: the previous pipeline stage's output (every stage but the first).

    Returns:
        the last tokens' logits, the stage's ``PPProxyTensors`` (a stage that is not the
        last), or None (a SPLIT_PREFILL call that stops before the last layer).
    """
    if runner.lora_manager is not None:
        per_req = (
            forward_batch.extend_seq_lens_cpu if forward_batch.forward_mode.is_extend() else None
        )
        per_req = per_req or [1] * forward_batch.batch_size
        runner.lora_manager.prepare_lora_batch(forward_batch.lora_names, per_req)
    runner.attn_backend.init_forward_metadata(forward_batch)
    with torch.inference_mode():
        embeds = input_embeds(runner, forward_batch)
        # the layer-range path of SPLIT_PREFILL is the model's own method, beside its plain forward
        run = (
            runner.model.forward_split_prefill
            if forward_batch.forward_mode.is_split_prefill()
            else runner.model.forward
        )
        out = run(
            forward_batch.input_ids,
            forward_batch.positions,
            forward_batch,
            input_embeds=embeds,
            pp_proxy_tensors=pp_proxy_tensors,
        )
    if runner.eplb_manager is not None:
        runner.eplb_manager.on_forward_pass_end()
    return out


def input_embeds(runner: Any, forward_batch: ForwardBatch) -> torch.Tensor | None:
    """(T, hidden_size): the token embeddings with rows ``input_embeds_indices`` replaced by
    ``input_embeds_values`` (the placeholder mechanism of multimodal models), or None."""
    if (
        forward_batch.input_embeds_indices is None
        or forward_batch.input_embeds_values is None
        or not runner.pipeline_stage.is_first
    ):
        return None
    embeds = runner.model.get_input_embeddings()(forward_batch.input_ids)  # (T, hidden)
    rows = forward_batch.input_embeds_indices.to(runner.device)
    embeds[rows] = forward_batch.input_embeds_values.to(device=runner.device, dtype=embeds.dtype)
    return embeds
