"""TpModelWorker: one TP rank's model worker, the interface the Scheduler drives (after SGLang).

Layering (the design notes)::

    Scheduler --ModelWorkerBatch--> TpModelWorker --ForwardBatch--> ModelRunner
              <-GenerationBatchResult--           <-GenerationBatchResult--

The worker owns the ``ModelRunner``, publishes the limits the scheduler plans with, turns a
``ModelWorkerBatch`` into a ``ForwardBatch`` and runs it through the runner's one step
(``forward_and_sample``), and routes weight updates to the runner. It never sees a
``ScheduleBatch``.

Init order (the design notes'): model config -> ModelRunner (process group, weights, KV pools,
backend, graphs) -> limits -> random-seed broadcast (from world rank 0 to every stage).

Pipeline parallelism (the design notes' ``forward_batch_generation`` branch): every stage but
the first receives the previous stage's ``PPProxyTensors`` first; every stage but the last sends
its own to the next stage and returns them unsampled; the last stage samples and sends the ids
(and logprobs) to every other stage, where :meth:`TpModelWorker.resolve_stage_outputs` receives
them, so every rank appends the same tokens.

Limits (tokens):
- ``max_total_num_tokens``: KV-cache slots of this rank (minimum over ranks).
- ``max_req_len = min(context_len - 1, max_total_num_tokens - 1)``: prompt + output of one request.
- ``max_req_input_len = max_req_len - 1``: longest prompt (leaves room for one output token;
  SGLang keeps 5, Shardline has no speculative tokens to reserve).
- ``max_running_requests``: request rows (one row is kept for padded CUDA-graph rows).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from shardline_runtime.configs.model_config import ModelConfig
from shardline_runtime.distributed import (
    PendingSends,
    broadcast_pyobj_world,
    recv_pyobj,
    recv_tensor_dict,
    send_pyobj,
    send_tensor_dict,
)
from shardline_runtime.managers.model_worker_batch import ModelWorkerBatch
from shardline_runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from shardline_runtime.model_executor.forward_batch_info import PPProxyTensors
from shardline_runtime.model_executor.generation_result import (
    GenerationBatchResult,
    logits_output_to_cpu,
)
from shardline_runtime.model_executor.model_runner import ModelRunner
from shardline_runtime.speculative.draft_worker import build_draft_worker, draft_update
from shardline_runtime.weights_state import CapturedGraphs, WeightsPhase

logger = logging.getLogger(__name__)

__all__ = ["BaseTpWorker", "GenerationBatchResult", "TpModelWorker"]


class BaseTpWorker(ABC):
    """What every TP worker offers the scheduler (SGLang's ``BaseTpWorker``)."""

    @abstractmethod
    def forward_batch_generation(
        self, model_worker_batch: ModelWorkerBatch
    ) -> GenerationBatchResult:
        """Run one prepared step and sample; see :meth:`TpModelWorker.forward_batch_generation`."""

    @property
    @abstractmethod
    def model_runner(self) -> ModelRunner:
        """The rank's ``ModelRunner``."""

    @property
    def sliding_window_size(self) -> int | None:
        """The model's sliding attention window in tokens, or None (from the runner)."""
        return self.model_runner.model_config.sliding_window_size

    @property
    def req_to_token_pool(self) -> ReqToTokenPool:
        return self.model_runner.req_to_token_pool

    @property
    def token_to_kv_pool_allocator(self) -> TokenToKVPoolAllocator:
        return self.model_runner.token_to_kv_pool_allocator


class TpModelWorker(BaseTpWorker):
    """The model side of one TP rank.

    Args:
        server_args: the ``ServerArgs`` (the runner takes its sections).
        tp_rank: this process's TP rank.
        model_runner: an already built runner (tests); default builds one.
        pp_rank: this process's pipeline stage.

    Raises:
        ModelConfigError: a bad config.json (before any weight is read).
        ValueError: the limits leave no room for a prompt.
        whatever ``ModelRunner`` raises (bad checkpoint, no memory).
    """

    def __init__(
        self,
        server_args: Any,
        tp_rank: int = 0,
        model_runner: ModelRunner | None = None,
        pp_rank: int = 0,
    ):
        self.server_args = server_args
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.pending_sends = PendingSends()  # stage-to-stage sends still in flight
        self._init_model_config(model_runner)
        self._init_model_runner(model_runner)
        self._init_limits()
        # STANDALONE / EAGLE: the draft's own runner and KV pools (raises DraftModelError)
        self.draft_worker = build_draft_worker(
            server_args, tp_rank, self.pp_rank, self.model_runner, self.max_total_num_tokens
        )
        # World rank 0's seed on every rank of every stage, so unseeded sampling draws the same numbers.
        self.random_seed = broadcast_pyobj_world(int(getattr(server_args, "random_seed", 0)))
        torch.manual_seed(self.random_seed)
        self.weight_sync_groups: dict[str, Any] = {}

    def _init_model_config(self, model_runner: ModelRunner | None) -> None:
        if model_runner is not None:
            self.model_config = model_runner.model_config
            return
        model = self.server_args.model
        self.model_config = ModelConfig.from_pretrained(
            model.model_path,
            dtype=model.dtype,
            context_length=model.context_length,
            device_type=self.server_args.parallel.torch_device(self.tp_rank, self.pp_rank).type,
            quantization=model.quantization,
        )

    def _init_model_runner(self, model_runner: ModelRunner | None) -> None:
        if model_runner is None:
            model_runner = ModelRunner(
                self.server_args, self.tp_rank, self.pp_rank, model_config=self.model_config
            )
        self._model_runner = model_runner
        self.model_config = model_runner.model_config  # the loaded model's (same values)
        self.tp_size = model_runner.tp_size
        self.pp_rank = getattr(model_runner, "pp_rank", self.pp_rank)
        self.pp_size = getattr(model_runner, "pp_size", 1)
        self.device = model_runner.device

    def _init_limits(self) -> None:
        runner = self.model_runner
        self.max_total_num_tokens = runner.max_total_num_tokens
        self.max_req_len = min(self.model_config.context_len - 1, self.max_total_num_tokens - 1)
        self.max_req_input_len = self.max_req_len - 1
        if self.max_req_input_len < 1:
            raise ValueError(
                f"max_total_num_tokens {self.max_total_num_tokens} / context length {self.model_config.context_len} "
                "leave no room for a prompt; raise --max-total-tokens or --context-length"
            )
        rows_free = runner.req_to_token_pool.available_size()
        self.max_running_requests = min(
            int(getattr(self.server_args, "max_running_requests", rows_free)), rows_free
        )

    @property
    def model_runner(self) -> ModelRunner:
        return self._model_runner

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
            "is_generation": self.model_runner.is_generation,
        }

    def forward_batch_generation(
        self, model_worker_batch: ModelWorkerBatch
    ) -> GenerationBatchResult:
        """Run one prepared step and sample one token per request that wants one.

        Returns:
            :class:`GenerationBatchResult` (ids and logprobs still on the device; the caller
            calls ``copy_to_cpu()`` then ``wait()``). Requests that want no token (intermediate
            chunks, ``max_new_tokens == 0``) get -1 and can still return prompt logprobs.
        """
        runner = self._model_runner
        forward_batch = model_worker_batch.to_forward_batch(runner)
        if self.pp_size == 1:  # one stage: nothing to receive or send (the common case)
            return runner.forward_and_sample(forward_batch)
        result = runner.forward_and_sample(forward_batch, self.recv_proxy_tensors())
        if self.is_last_stage:
            self.send_stage_outputs(result.copy_to_cpu().wait())
        else:  # the ids come later (resolve_stage_outputs)
            self.send_proxy_tensors(result.pp_hidden_states_proxy_tensors)
        return result

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def recv_proxy_tensors(self) -> PPProxyTensors | None:
        """The previous stage's ``PPProxyTensors`` of this step (blocks); None on the first stage."""
        if self.is_first_stage:
            return None
        return PPProxyTensors(recv_tensor_dict(self.pp_rank - 1, self.device))

    def send_proxy_tensors(self, proxy: PPProxyTensors) -> None:
        """Send this stage's ``PPProxyTensors`` to the next stage, without waiting."""
        send_tensor_dict(proxy.tensors, self.pp_rank + 1, self.pending_sends)

    def send_stage_outputs(self, result: GenerationBatchResult) -> None:
        """Last stage: send the sampled ids and logprobs (host lists), and the logits object when
        a request asked for prompt logprobs, to every other stage without waiting."""
        batch = result.forward_batch
        logits = result.logits_output if batch.return_logprob else None
        if logits is not None:  # tensors travel pickled: move them off the device first
            logits = logits_output_to_cpu(logits)
        assert result.next_token_ids is not None  # the last stage sampled
        payload = (
            result.next_token_ids.tolist(),
            result.next_token_logprobs,
            result.next_token_top_logprobs,
            logits,
        )
        for stage in range(self.pp_size - 1):
            send_pyobj(payload, stage, self.pending_sends)

    def resolve_stage_outputs(self, result: GenerationBatchResult) -> GenerationBatchResult:
        """The step's sampled ids and logprobs on the host, on every stage: the last stage's own
        (``copy_to_cpu().wait()``); the others receive them from the last stage, in step order."""
        if result.pp_hidden_states_proxy_tensors is None:
            return result.copy_to_cpu().wait()
        ids, logprobs, tops, logits = recv_pyobj(self.pp_size - 1)
        result.next_token_ids = torch.tensor(ids, dtype=torch.int64)
        result.next_token_logprobs, result.next_token_top_logprobs = logprobs, tops
        result.logits_output = logits
        return result

    def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str = "auto",
        recapture_cuda_graph: bool = True,
        on_phase: Callable[[WeightsPhase], None] | None = None,
        cancelled: Callable[[], bool] | None = None,
        draft_model_path: str | None = None,
        staged: Any = None,
    ) -> tuple[bool, str]:
        """Route an update from disk to ``ModelRunner.update_weights_from_disk`` (every rank;
        ``staged``: its weights staged while serving, ``weight_staging.BackgroundStaging``).

        With ``draft_model_path`` the draft model's new checkpoint is staged and checked beside
        the target's and both commit together or neither does; the draft's KV is then dropped
        (it was computed by the old draft weights). ``on_phase`` is called with each phase as it begins (``loading``, ``recapturing``, then
        ``serving`` or ``failed``), so the scheduler can report progress while this call runs.
        ``cancelled`` is polled while the new weights are staged; True stops the update before
        it commits (``POST /abort_weight_update``). The caller (Scheduler) drains or aborts
        running requests first and flushes the prefix cache afterwards; its control plane records
        which weights serve (``ControlPlane.weights``). On failure the old weights keep serving.
        Returns ``(success, message)``.
        """
        draft, refused = draft_update(self.draft_worker, draft_model_path)
        if refused:
            return False, refused
        ok, message = self.model_runner.update_weights_from_disk(
            model_path,
            load_format,
            recapture_cuda_graph=recapture_cuda_graph,
            on_phase=on_phase,
            cancelled=cancelled,
            draft=draft,
            staged=staged,
        )
        if ok and draft is not None and self.draft_worker is not None:
            self.draft_worker.release_all()
        logger.info(
            "[tp %d] update_weights_from_disk(%s): %s %s", self.tp_rank, model_path, ok, message
        )
        return ok, message

    def update_cuda_graph_settings(
        self,
        cuda_graph_max_bs: int | None,
        disable: bool,
        on_phase: Callable[[WeightsPhase], None] | None = None,
    ) -> None:
        """New decode-graph settings from an update request; the runner rebuilds its graphs."""
        self.model_runner.graphs.rebuild(cuda_graph_max_bs, disable, on_phase)

    def captured_graphs(self) -> CapturedGraphs:
        """What this rank's runner (and its draft model's runner) really captured
        (``DeviceGraphs.report``)."""
        draft = self.draft_worker.runner.graphs if self.draft_worker is not None else None
        return self.model_runner.graphs.report(draft)

    # ---- weight sync from a trainer (model_executor/weight_sync.py) ----------------------------

    def update_weights_from_tensor(self, data: bytes) -> tuple[bool, str, list[str]]:
        """All-or-nothing load of the tensors in ``data`` (safetensors bytes) on every rank."""
        from shardline_runtime.model_executor.weight_sync import update_weights_from_safetensors

        return update_weights_from_safetensors(self.model_runner, data)

    def init_weights_update_group(self, msg: Any) -> tuple[bool, str]:
        """Every rank joins ``msg.group_name`` as rank ``rank_offset + world_rank`` (``world_rank =
        pp_rank * tp_size + tp_rank``; just ``tp_rank`` without pipeline parallelism), or none does."""
        from shardline_runtime.distributed import all_reduce_min_int
        from shardline_runtime.distributed.weight_sync_group import (
            WeightSyncGroupError,
            destroy_weights_update_group,
            init_weights_update_group,
        )

        group, reason = None, ""
        if msg.group_name in self.weight_sync_groups:
            reason = f"group_name {msg.group_name!r} is already initialised; destroy it first"
        else:
            try:
                group = init_weights_update_group(
                    msg.master_address,
                    msg.master_port,
                    msg.rank_offset + self.pp_rank * self.tp_size + self.tp_rank,
                    msg.world_size,
                    msg.group_name,
                    msg.backend,
                    msg.timeout_s,
                )
            except WeightSyncGroupError as exc:
                reason = str(exc)
        if all_reduce_min_int(0 if reason else 1) != 1:
            if group is not None:
                destroy_weights_update_group(group)
            return (
                False,
                f"init_weights_update_group failed on some rank; no group was formed. {reason}".strip(),
            )
        assert group is not None  # every rank formed it (the agreement above)
        self.weight_sync_groups[msg.group_name] = group
        return (
            True,
            f"joined weight-sync group {msg.group_name!r} as rank {group.rank} of {group.world_size}",
        )

    def update_weights_from_distributed(
        self, msg: Any, refused: str = ""
    ) -> tuple[bool, str, list[str]]:
        """Receive and load ``msg.names`` from the trainer; a broken broadcast drops the group.
        With ``refused`` (why the update cannot run) the tensors are received and discarded."""
        from shardline_runtime.distributed.weight_sync_group import destroy_weights_update_group
        from shardline_runtime.model_executor.weight_sync import update_weights_from_distributed

        group = self.weight_sync_groups.get(msg.group_name)
        if group is None:
            known = sorted(self.weight_sync_groups)
            return (
                False,
                f"group_name {msg.group_name!r} is not initialised (initialised: {known}); call /init_weights_update_group",
                [],
            )
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
            return (
                False,
                f"group_name {group_name!r} is not initialised (initialised: {sorted(self.weight_sync_groups)})",
            )
        destroy_weights_update_group(group)
        return True, f"destroyed weight-sync group {group_name!r}"

    def get_weights_by_name(self, name: str, truncate_size: int) -> list:
        """First ``truncate_size`` rows of the full tensor ``name`` (every rank calls it)."""
        from shardline_runtime.model_executor.weight_sync import get_weights_by_name

        return get_weights_by_name(self.model_runner, name, truncate_size)
