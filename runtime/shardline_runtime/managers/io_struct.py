"""Typed messages between the HTTP process and the schedulers (pickled over ZMQ and gloo).

Direction and meaning:

- HTTP -> rank-0 scheduler (and broadcast by rank 0 to every rank): ``TokenizedGenerateReqInput``,
  ``AbortReq``, ``FlushCacheReqInput``, ``UpdateWeightsFromDiskReqInput``,
  ``ExpertDistributionReqInput``, ``RebalanceExpertsReqInput`` (MoE models), and the weight-sync
  and memory controls (``UpdateWeightsFromTensorReqInput``, ``UpdateWeightsFromDistributedReqInput``,
  ``InitWeightsUpdateGroupReqInput``, ``DestroyWeightsUpdateGroupReqInput``,
  ``GetWeightsByNameReqInput``, ``PauseGenerationReqInput``, ``ContinueGenerationReqInput``,
  ``ReleaseMemoryOccupationReqInput``, ``ResumeMemoryOccupationReqInput``).
- Rank-0 scheduler -> HTTP: ``BatchTokenIDOut`` (new token ids of many requests per step),
  ``FlushCacheReqOutput``, ``UpdateWeightsFromDiskReqOutput``, ``ExpertDistributionReqOutput``,
  ``RebalanceExpertsReqOutput``, ``ControlReqOutput`` (reply to every weight-sync and memory
  control), ``WeightsState`` (``weights_state.py``: the serving weights, sent whole whenever a
  field changed), ``ServingStateOut``, and ``SchedulerStats`` whenever load or KV usage changed.

Token ids are Python ints; logprobs are natural-log floats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shardline_runtime.managers.weights_state import WeightsState
from shardline_runtime.sampling.sampling_params import SamplingParams


@dataclass
class TokenizedGenerateReqInput:
    """One generation request, already tokenized and validated by the HTTP process.

    ``logprob_start_len``: prompt position from which prompt logprobs are returned, or -1 for
    none. ``top_logprobs_num``: number of alternatives per position (0 for none).
    """

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    stream: bool = False
    lora_name: str | None = None  # a loaded LoRA adapter (None: the base model)
    # Caller-given embeddings of prompt positions (validated: in range, hidden_size floats each).
    input_embeds_positions: list[int] | None = None
    input_embeds_values: list[list[float]] | None = None


@dataclass
class AbortReq:
    """Abort ``rid`` (or every request when ``rid`` is None); ``finish_reason`` is reported.

    ``finish_reason`` is a dict like ``{"type": "abort", "message": ...}`` or, when the HTTP
    process matched a stop string, ``{"type": "stop", "matched": "..."}``: the scheduler frees
    the request either way.
    """

    rid: str | None
    finish_reason: dict[str, Any] = field(
        default_factory=lambda: {"type": "abort", "message": "aborted"}
    )


@dataclass
class FlushCacheReqInput:
    """Drop every prefix-cache entry (only when no request runs)."""


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclass
class UpdateWeightsFromDiskReqInput:
    """DESIGN 2.4: reload weights from ``model_path`` on every rank, in place."""

    model_path: str
    load_format: str | None = None
    revision: str | None = None
    recapture_cuda_graph: bool = True
    abort_all_requests: bool = False
    cuda_graph_max_bs: int | None = None  # new graph settings (GPU only), applied after the load
    disable_cuda_graph: bool | None = None
    weight_version: str | None = None
    flush_cache: bool = True


@dataclass
class UpdateWeightsFromDiskReqOutput:
    """Reply to a disk update; what serves afterwards arrives just before it, as the new
    ``WeightsState``."""

    success: bool
    message: str
    load_seconds: float | None = None  # rank 0's time in ``loading`` (None: the update never ran)
    recapture_seconds: float | None = None  # rank 0's time in ``recapturing`` (0.0: no graphs)


@dataclass
class UpdateWeightsFromTensorReqInput:
    """Load full tensors given as the bytes of a safetensors file (checkpoint names)."""

    serialized_named_tensors: bytes
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


@dataclass
class UpdateWeightsFromDistributedReqInput:
    """Receive ``names`` by broadcast from rank 0 (the trainer) of weight-sync group ``group_name``."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


@dataclass
class InitWeightsUpdateGroupReqInput:
    """Every engine rank joins group ``group_name`` as rank ``rank_offset + tp_rank``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str = "gloo"
    timeout_s: float = 120.0


@dataclass
class DestroyWeightsUpdateGroupReqInput:
    group_name: str


@dataclass
class GetWeightsByNameReqInput:
    name: str
    truncate_size: int = 100


@dataclass
class PauseGenerationReqInput:
    """``mode``: ``abort`` (default), ``retract`` or ``in_place`` (SGLang's three modes)."""

    mode: str = "abort"


@dataclass
class ContinueGenerationReqInput:
    pass


@dataclass
class ReleaseMemoryOccupationReqInput:
    tags: Sequence[str] | None = None


@dataclass
class ResumeMemoryOccupationReqInput:
    tags: Sequence[str] | None = None


@dataclass
class ControlReqOutput:
    """Reply to a weight-sync or memory control; ``data`` carries e.g. the tensor values of
    ``get_weights_by_name``. A call that changed the weights sends the new ``WeightsState``
    just before this reply."""

    success: bool
    message: str
    data: Any = None


@dataclass
class ServingStateOut:
    """Rank 0 reports why generation cannot run now (``blocked``: released memory or weights
    missing after a resume, else None) and the pause mode (None when not paused)."""

    blocked: str | None
    paused: str | None


@dataclass
class SchedulerStats:
    """Load and memory of the rank-0 scheduler (token counts are KV slots)."""

    num_running_reqs: int
    num_queued_reqs: int
    kv_used_tokens: int
    kv_evictable_tokens: int
    max_total_num_tokens: int

    @property
    def kv_usage(self) -> float:
        """Fraction in [0, 1] of KV slots held by requests (prefix-cache entries not counted)."""
        return self.kv_used_tokens / max(1, self.max_total_num_tokens)


@dataclass
class SchedulerInfo:
    """Sent once by each scheduler when ready: the limits the HTTP process validates against."""

    tp_rank: int
    max_total_num_tokens: int
    max_req_len: int
    max_req_input_len: int
    context_len: int
    vocab_size: int
    max_running_requests: int
    weights: WeightsState  # what serves at start (later changes arrive as new records)
    eos_token_ids: list[int] = field(default_factory=list)
    hidden_size: int = 0  # width of one input_embeds vector
    overlap_schedule: bool = False  # the overlap scheduler runs (off with LoRA, PP or the flag)


@dataclass
class BatchTokenIDOut:
    """New tokens of several requests after one scheduler step (rank 0 -> HTTP).

    Per request ``i``: ``output_ids[i]`` are the tokens generated since the last message;
    ``finished_reasons[i]`` is None while running, else ``{"type": "stop", "matched": id}``,
    ``{"type": "length", "length": n}`` or ``{"type": "abort", "message": ...}``.
    ``output_token_logprobs[i]`` pairs ``(logprob, token_id)`` with ``output_ids[i]``;
    ``output_top_logprobs[i][j]`` is a list of ``(logprob, token_id)`` for that position.
    ``input_token_logprobs[i]`` is set once (first message) when prompt logprobs were asked.
    """

    rids: list[str]
    output_ids: list[list[int]]
    finished_reasons: list[dict[str, Any] | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs: list[list[tuple[float, int]] | None]
    output_top_logprobs: list[list[list[tuple[float, int]]] | None]
    input_token_logprobs: list[list[tuple[float | None, int]] | None]
    input_top_logprobs: list[list[list[tuple[float, int]]] | None]


@dataclass
class ExpertDistributionReqInput:
    """Expert-distribution recorder control: ``action`` is ``start`` (with ``mode``), ``stop``
    or ``dump`` (``to_file``: write into ``--expert-distribution-recorder-dir``)."""

    action: str
    mode: str | None = None
    to_file: bool = False


@dataclass
class ExpertDistributionReqOutput:
    success: bool
    message: str = ""
    record: dict[str, Any] | None = None


@dataclass
class RebalanceExpertsReqInput:
    """Re-place the experts (EPLB) from the recorded load, on every rank."""


@dataclass
class RebalanceExpertsReqOutput:
    """Imbalance is max / mean tokens per expert-parallel rank (1.0 = balanced)."""

    success: bool
    message: str
    imbalance_before: float | None = None
    imbalance_after_expected: float | None = None
    moved_experts: int = 0
