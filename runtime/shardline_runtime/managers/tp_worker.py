"""TpModelWorker: one TP rank's model worker, the interface the Scheduler drives (after SGLang).

It owns the ``ModelRunner``, publishes the limits the scheduler plans with, turns a
``ScheduleBatch`` into a ``ForwardBatch``, runs it and samples, and routes weight updates.

Limits (tokens):
- ``max_total_num_tokens``: KV-cache slots of this rank (minimum over ranks).
- ``max_req_len = min(context_len - 1, max_total_num_tokens - 1)``: prompt + output of one request.
- ``max_req_input_len = max_req_len - 1``: longest prompt (leaves room for one output token).
- ``max_running_requests``: request rows (one row is kept for padded CUDA-graph rows).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import torch

from shardline_runtime.distributed import broadcast_pyobj
from shardline_runtime.layers.sampler import Sampler, SamplerOutput
from shardline_runtime.managers.schedule_batch import ScheduleBatch
from shardline_runtime.model_executor.forward_batch_info import ForwardBatch
from shardline_runtime.model_executor.model_runner import ModelRunner, ModelRunnerConfig
from shardline_runtime.model_executor.weight_update import WeightsPhase, update_weights_from_disk

logger = logging.getLogger(__name__)


@dataclass
class GenerationBatchResult:
    """Outcome of one ``forward_batch_generation`` call for a batch of ``bs`` requests.

    Attributes:
        logits_output: the model's ``LogitsProcessorOutput`` (``next_token_logits`` (bs, vocab)
            float32; ``input_token_logprobs`` etc. when prompt logprobs were asked).
        forward_batch: the ``ForwardBatch`` that ran.
        next_token_ids: (bs,) int64 on CPU; -1 for rows that sampled nothing (intermediate
            chunks, prefill-only requests). ``None`` until sampled (delayed sampling).
        next_token_logprobs: per row, the raw logprob of the sampled token, or ``None``.
        next_token_top_logprobs: per row, ``(values, token_ids)`` or ``None``.
    """

    logits_output: Any
    forward_batch: ForwardBatch
    next_token_ids: torch.Tensor | None = None
    next_token_logprobs: list[float | None] = field(default_factory=list)
    next_token_top_logprobs: list[tuple[list[float], list[int]] | None] = field(default_factory=list)


class TpModelWorker:
    """The model side of one TP rank.

    Args:
        server_args: a ``ServerArgs`` (or any object with the ``ModelRunnerConfig`` fields,
            plus ``revision``).
        tp_rank: this process's TP rank.
        model_runner: an already built runner (tests); default builds one.

    Raises:
        whatever ``ModelRunner`` raises (bad config, bad checkpoint, no memory).
    """

    def __init__(self, server_args: Any, tp_rank: int = 0, model_runner: ModelRunner | None = None):
        self.server_args = server_args
        self.tp_rank = tp_rank
        if model_runner is None:
            model_runner = ModelRunner(ModelRunnerConfig.from_server_args(server_args, tp_rank))
        self.model_runner = model_runner
        self.model_config = model_runner.model_config
        self.tp_size = model_runner.tp_size
        self.device = model_runner.device
        # Rank 0's seed everywhere, so unseeded sampling draws the same numbers on every rank.
        self.random_seed = broadcast_pyobj(int(getattr(server_args, "random_seed", 0)))
        torch.manual_seed(self.random_seed)
        if self.tp_size > 1:
            self.sampler = Sampler(broadcast=self._broadcast_token_ids)
        else:
            self.sampler = Sampler()
        self.max_total_num_tokens = model_runner.max_total_num_tokens
        self.max_req_len = min(self.model_config.context_len - 1, self.max_total_num_tokens - 1)
        self.max_req_input_len = self.max_req_len - 1
        if self.max_req_input_len < 1:
            raise ValueError(
                f"max_total_num_tokens {self.max_total_num_tokens} / context length {self.model_config.context_len} "
                "leave no room for a prompt; raise --max-total-tokens or --context-length"
            )
        rows_free = model_runner.req_to_token_pool.available_size()
        self.max_running_requests = min(int(getattr(server_args, "max_running_requests", rows_free)), rows_free)
        self.model_path = self.model_config.model_path
        self.weights_revision = getattr(server_args, "revision", None)
        self.weights_phase = WeightsPhase.SERVING
        self.weight_version = str(getattr(server_args, "weight_version", "default"))
        self.weight_sync_groups: dict[str, Any] = {}

    @staticmethod
    def _broadcast_token_ids(ids: torch.Tensor) -> None:
        ids.copy_(torch.tensor(broadcast_pyobj(ids.tolist()), dtype=ids.dtype))

    def get_worker_info(self) -> dict[str, Any]:
        """Limits and identity for the scheduler and ``/get_server_info``."""
        return {
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_req_len": self.max_req_len,
            "max_req_input_len": self.max_req_input_len,
            "max_running_requests": self.max_running_requests,
            "random_seed": self.random_seed,
            "context_len": self.model_config.context_len,
            "vocab_size": self.model_config.vocab_size,
            "device": str(self.device),
            "model_path": self.model_path,
            "weights_revision": self.weights_revision,
            "weights_phase": self.weights_phase.value,
            "weight_version": self.weight_version,
        }

    @property
    def req_to_token_pool(self):
        return self.model_runner.req_to_token_pool

    @property
    def token_to_kv_pool_allocator(self):
        return self.model_runner.token_to_kv_pool_allocator

    def new_batch(self, reqs: list) -> ScheduleBatch:
        """A ``ScheduleBatch`` over this worker's pools, vocabulary and device."""
        return ScheduleBatch(
            reqs, self.req_to_token_pool, self.token_to_kv_pool_allocator, self.model_config.vocab_size, self.device
        )

    def forward_batch_generation(self, batch: ScheduleBatch, skip_sample: bool = False) -> GenerationBatchResult:
        """Run the prepared step of ``batch`` and sample one token per request that needs one.

        Args:
            batch: prepared with ``prepare_for_extend`` / ``prepare_for_decode``.
            skip_sample: delayed-sampling hook (overlap scheduling): return after the forward;
                call :meth:`sample` later with the result.

        Returns:
            :class:`GenerationBatchResult`; requests with ``wants_token == False`` (intermediate
            chunks, ``max_new_tokens == 0``) get -1 and can still return prompt logprobs.
        """
        forward_batch = batch.get_forward_batch(self.model_runner)
        logits_output = self.model_runner.forward(forward_batch)
        result = GenerationBatchResult(logits_output=logits_output, forward_batch=forward_batch)
        if not skip_sample:
            self.sample(result, batch)
        return result

    def sample(self, result: GenerationBatchResult, batch: ScheduleBatch) -> GenerationBatchResult:
        """Fill ``result.next_token_*`` for the rows that want a token; updates penalty counts."""
        bs = batch.batch_size
        rows = [i for i, req in enumerate(batch.reqs) if req.wants_token]
        next_ids = torch.full((bs,), -1, dtype=torch.int64)
        result.next_token_logprobs = [None] * bs
        result.next_token_top_logprobs = [None] * bs
        if rows:
            batch_info = batch.sampling_info
            if batch_info is None:
                raise ValueError("the batch was not prepared (no sampling_info)")
            info = batch_info if len(rows) == bs else batch_info.copy_rows(rows)
            logits = result.logits_output.next_token_logits
            if len(rows) < bs:
                logits = logits[torch.tensor(rows, device=logits.device)]
            want_logprob = [batch.reqs[i].return_logprob for i in rows]
            top_nums = [batch.reqs[i].top_logprobs_num if batch.reqs[i].return_logprob else 0 for i in rows]
            out: SamplerOutput = self.sampler(logits, info, any(want_logprob), top_nums if any(top_nums) else None)
            sampled = out.next_token_ids
            if batch_info.penalties is not None:
                batch_info.penalties.cumulate_output_tokens(
                    sampled, torch.tensor(rows, device=sampled.device)
                )
            sampled_cpu = sampled.cpu()
            logprobs = out.next_token_logprobs.tolist() if out.next_token_logprobs is not None else None
            for j, row in enumerate(rows):
                next_ids[row] = sampled_cpu[j]
                if want_logprob[j] and logprobs is not None:
                    result.next_token_logprobs[row] = logprobs[j]
                if top_nums[j] and out.top_logprobs_val is not None and out.top_logprobs_idx is not None:
                    result.next_token_top_logprobs[row] = (out.top_logprobs_val[j], out.top_logprobs_idx[j])
        result.next_token_ids = next_ids
        return result

    def update_weights_from_disk(
        self, model_path: str, load_format: str = "auto", revision: str | None = None,
        recapture_cuda_graph: bool = True,
        on_phase: Callable[[WeightsPhase], None] | None = None,
    ) -> tuple[bool, str]:
        """Validate and load new weights in place on every rank; see ``weight_update.py``.

        ``on_phase`` is called with each phase as it begins (``loading``, ``recapturing``, then
        ``serving`` or ``failed``), so the scheduler can report progress while this call runs.

        The caller (Scheduler) pauses admission, drains or aborts running requests first and
        flushes the prefix cache afterwards. Updates ``weights_phase``, ``weights_revision`` and
        ``model_path`` on success; on failure the old weights keep serving and
        ``weights_phase`` is ``failed`` until the next successful update.

        Returns:
            ``(success, message)``.
        """

        def set_phase(phase: WeightsPhase) -> None:
            self.weights_phase = phase
            if on_phase is not None:
                on_phase(phase)

        ok, message = update_weights_from_disk(
            self.model_runner, model_path, load_format=load_format,
            recapture_cuda_graph=recapture_cuda_graph, on_phase=set_phase,
        )
        if ok:
            self.model_path = model_path
            self.weights_revision = revision
        logger.info("[tp %d] update_weights_from_disk(%s): %s %s", self.tp_rank, model_path, ok, message)
        return ok, message

    # ---- weight sync from a trainer (model_executor/weight_sync.py) ----------------------------

    def update_weights_from_tensor(self, data: bytes) -> tuple[bool, str, list[str]]:
        """All-or-nothing load of the tensors in ``data`` (safetensors bytes) on every rank."""
        from shardline_runtime.model_executor.weight_sync import update_weights_from_safetensors

        return update_weights_from_safetensors(self.model_runner, data)

    def init_weights_update_group(self, msg: Any) -> tuple[bool, str]:
        """Every rank joins ``msg.group_name`` as rank ``rank_offset + tp_rank`` (or none does)."""
        from shardline_runtime.distributed import all_reduce_min_int
        from shardline_runtime.distributed.weight_sync_group import (
            WeightSyncGroupError, destroy_weights_update_group, init_weights_update_group,
        )

        group, reason = None, ""
        if msg.group_name in self.weight_sync_groups:
            reason = f"group_name {msg.group_name!r} is already initialised; destroy it first"
        else:
            try:
                group = init_weights_update_group(
                    msg.master_address, msg.master_port, msg.rank_offset + self.tp_rank, msg.world_size,
                    msg.group_name, msg.backend, msg.timeout_s, self.device,
                )
            except WeightSyncGroupError as exc:
                reason = str(exc)
        if all_reduce_min_int(0 if reason else 1) != 1:
            if group is not None:
                destroy_weights_update_group(group)
            return False, f"init_weights_update_group failed on some rank; no group was formed. {reason}".strip()
        assert group is not None  # every rank formed it (the agreement above)
        self.weight_sync_groups[msg.group_name] = group
        return True, f"joined weight-sync group {msg.group_name!r} as rank {group.rank} of {group.world_size}"

    def update_weights_from_distributed(self, msg: Any, refused: str = "") -> tuple[bool, str, list[str]]:
        """Receive and load ``msg.names`` from the trainer; a broken broadcast drops the group.
        With ``refused`` (why the update cannot run) the tensors are received and discarded."""
        from shardline_runtime.distributed.weight_sync_group import destroy_weights_update_group
        from shardline_runtime.model_executor.weight_sync import update_weights_from_distributed

        group = self.weight_sync_groups.get(msg.group_name)
        if group is None:
            known = sorted(self.weight_sync_groups)
            return False, f"group_name {msg.group_name!r} is not initialised (initialised: {known}); call /init_weights_update_group", []
        ok, message, names, broken = update_weights_from_distributed(
            self.model_runner, group, msg.names, msg.dtypes, msg.shapes, refused
        )
        if broken:
            destroy_weights_update_group(self.weight_sync_groups.pop(msg.group_name))
            message += f" Group {msg.group_name!r} was destroyed; init a new one."
        return ok, message, names

    def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        from shardline_runtime.distributed.weight_sync_group import destroy_weights_update_group

        group = self.weight_sync_groups.pop(group_name, None)
        if group is None:
            return False, f"group_name {group_name!r} is not initialised (initialised: {sorted(self.weight_sync_groups)})"
        destroy_weights_update_group(group)
        return True, f"destroyed weight-sync group {group_name!r}"

    def get_weights_by_name(self, name: str, truncate_size: int) -> list:
        """First ``truncate_size`` rows of the full tensor ``name`` (every rank calls it)."""
        from shardline_runtime.model_executor.weight_sync import get_weights_by_name

        return get_weights_by_name(self.model_runner, name, truncate_size)
