"""Typed messages between the HTTP process and the schedulers (pickled over ZMQ and gloo).

Direction and meaning:

- HTTP -> rank-0 scheduler (and broadcast by rank 0 to every rank): ``TokenizedGenerateReqInput``,
  ``AbortReq``, ``FlushCacheReqInput``, ``UpdateWeightsFromDiskReqInput``,
  ``ExpertDistributionReqInput``, ``RebalanceExpertsReqInput`` (MoE models), and the weight-sync
  and memory controls (``UpdateWeightsFromTensorReqInput``, ``UpdateWeightsFromDistributedReqInput``,
  ``InitWeightsUpdateGroupReqInput``, ``DestroyWeightsUpdateGroupReqInput``,
  ``GetWeightsByNameReqInput``, ``PauseGenerationReqInput``, ``ContinueGenerationReqInput``,
  ``ReleaseMemoryOccupationReqInput``, ``ResumeMemoryOccupationReqInput``),
  ``LoadLoRAAdapterReqInput``, ``UnloadLoRAAdapterReqInput``.
- Rank-0 scheduler -> HTTP: ``BatchTokenOut`` (one :class:`TokenOut` per request that advanced
  in a step), ``FlushCacheReqOutput``, ``UpdateWeightsFromDiskReqOutput``,
  ``ExpertDistributionReqOutput``, ``RebalanceExpertsReqOutput``, ``ControlReqOutput`` (reply to
  every weight-sync and memory control), ``LoRAAdapterReqOutput``, the whole
  :class:`~shardline_runtime.weights_state.WeightsState` whenever it changes,
  ``ServingStateOut``, and ``SchedulerStats`` whenever load or KV usage changed.

Token ids are Python ints; logprobs are natural-log floats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from shardline_runtime.configs.pooling_config import PoolingConfig
from shardline_runtime.constrained.grammar_spec import GrammarSpec
from shardline_runtime.managers.io_lora_experts import (  # noqa: F401  (re-exported)
    ExpertDistributionReqInput,
    ExpertDistributionReqOutput,
    LoadLoRAAdapterReqInput,
    LoRAAdapterReqOutput,
    RebalanceExpertsReqInput,
    RebalanceExpertsReqOutput,
    UnloadLoRAAdapterReqInput,
)
from shardline_runtime.managers.message_pickling import compact_pickle, compact_step_pickle
from shardline_runtime.sampling.sampling_params import SamplingParams
from shardline_runtime.weights_state import WeightsState


@dataclass(kw_only=True)
class TokenizedGenerateReqInput:
    """One generation request, already tokenized and validated by the HTTP process: the one
    record of a request's options from the HTTP handler to the scheduler (keyword-only, so a new
    option is one field here).

    ``logprob_start_len``: prompt position from which prompt logprobs are returned, or -1 for
    none. ``top_logprobs_num``: number of alternatives per position (0 for none).
    ``include_stop_str_in_output`` is read by the HTTP process's detokenizer only.
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
    include_stop_str_in_output: bool = False
    # Constrained decoding (validated by compiling it in the HTTP process); None: free text.
    grammar: GrammarSpec | None = None
    # When the HTTP process admitted it (its time.monotonic): before a disk update's
    # requested_at, it is served before that update pauses (None: it waits for the update).
    admitted_at: float | None = None


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
    # The hf:// or s3:// reference model_path (a fetched directory) came from: reported instead.
    model_source: str | None = None
    # The draft model's or EAGLE head's new checkpoint (a local directory), committed with the
    # target's or not at all; draft_model_source: the hf:// or s3:// reference it was fetched from.
    draft_model_path: str | None = None
    draft_model_source: str | None = None
    # When the HTTP process began holding new requests for it (its time.monotonic; None: only
    # requests that already started finish before the update, or, with ``admit_seconds``, not
    # yet known: a ``WeightUpdateCutoffReqInput`` brings it).
    requested_at: float | None = None
    # Seconds the HTTP process goes on admitting new requests (served on the old weights)
    # while the new ones stage; the cutoff follows as its own message (0: at once).
    admit_seconds: float = 0.0


@dataclass
class UpdateWeightsFromDiskReqOutput:
    """Reply to a disk update; what serves afterwards arrives just before it, as the new
    ``WeightsState``."""

    success: bool
    message: str
    load_seconds: float | None = None  # rank 0's time in ``loading`` (None: the update never ran)
    recapture_seconds: float | None = None  # rank 0's time in ``recapturing`` (0.0: no graphs)
    aborted: bool = False  # stopped by ``AbortWeightUpdateReqInput`` before it committed


@dataclass
class AbortWeightUpdateReqInput:
    """Abort the disk update queued or staging its weights (``POST /abort_weight_update``).

    No reply of its own: the update's reply says ``aborted``, or that it had committed. Rank 0
    also looks for this message on its input while an update stages its weights.
    """


@dataclass
class WeightUpdateCutoffReqInput:
    """The end of a disk update's admission window (``admit_seconds``): the HTTP process
    holds new requests from ``requested_at`` (its ``time.monotonic``) on. The pending update
    commits only after this arrives, once the requests admitted before it are done; no reply.
    """

    requested_at: float


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
    """Load and memory of the rank-0 scheduler (token counts are KV slots).

    ``running_lora_adapters`` / ``waiting_lora_adapters``: the adapter names of running and of
    queued requests, sorted, without repeats (empty without LoRA).
    """

    num_running_reqs: int
    num_queued_reqs: int
    kv_used_tokens: int
    kv_evictable_tokens: int
    max_total_num_tokens: int
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    # with --speculative-algorithm: a copy of the cumulative SpeculativeStats
    speculative: Any = None

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
    # an embedding model's pooling (None: a generation model; ModelConfig.is_generation)
    pooling: PoolingConfig | None = None

    @property
    def is_generation(self) -> bool:
        return self.pooling is None


FinishType = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class FinishReason:
    """Why a request ended: ``type`` is ``"stop"`` (EOS / stop token: ``matched`` is the id; a
    stop string matched by the detokenizer: the string), ``"length"`` (max_new_tokens or the
    context limit: ``matched`` is the limit) or ``"abort"`` (``message`` says why)."""

    type: FinishType
    matched: int | str | None = None
    message: str | None = None

    @classmethod
    def from_dict(cls, reason: dict[str, Any]) -> FinishReason:
        """An ``AbortReq``'s reason (``{"type"?, "matched"?, "message"?}``; type default abort)."""
        return cls(reason.get("type", "abort"), reason.get("matched"), reason.get("message"))

    def to_dict(self) -> dict[str, Any]:
        """SGLang's ``meta_info.finish_reason`` object: ``{"type", "matched"}`` for stop,
        ``{"type", "length"}`` for length, plus ``"message"`` when set."""
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.matched
        if self.message:
            out["message"] = self.message
        return out


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position's logprob: ``logprob`` (natural log; None for a prompt's first token, which
    has no context), ``token_id`` and ``top``: ``(logprob, token_id)`` alternatives, best first."""

    logprob: float | None
    token_id: int
    top: list[tuple[float, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request so far: prompt tokens, completion tokens generated, prompt
    tokens served from the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenOut:
    """What one request produced in one scheduler step (rank 0 -> HTTP).

    ``ids``: token ids generated since the last message; ``logprobs``: one per id when the
    request asked for logprobs, else empty; ``prompt_logprobs``: set once (with the first message)
    when prompt logprobs were asked; ``finish``: None while running; ``usage`` counts the whole
    request so far; ``embedding`` (embedding models, with the finish): the pooled vector,
    hidden_size floats (normalised when the model's pooling says so).
    """

    rid: str
    ids: list[int]
    usage: Usage
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    finish: FinishReason | None = None
    embedding: list[float] | None = None


@dataclass(frozen=True, slots=True)
class BatchTokenOut:
    """The :class:`TokenOut` of every request that advanced in one step, in batch order."""

    outs: list[TokenOut]


compact_pickle(FinishReason, TokenLogprob, Usage, TokenOut)  # sent every step
compact_step_pickle(BatchTokenOut, TokenOut, Usage)
