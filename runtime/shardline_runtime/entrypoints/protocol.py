"""Request bodies of the HTTP API (pydantic), OpenAI's field names and defaults.

Ranges that pydantic checks here produce a 400 naming the field; the sampling ranges
(temperature, top_p, top_k, min_p, penalties, seed) are checked once, by ``SamplingParams``.
Documented choices (docs/api.md): ``max_tokens: 0`` is accepted on ``/v1/completions`` with
``echo: true`` only (the prompt is scored, nothing is generated: how lm-evaluation-harness asks
for loglikelihoods), a 400 otherwise; ``/generate`` accepts ``max_new_tokens: 0``;
``add_special_tokens`` defaults to the tokenizer's own behaviour for text prompts (completions,
``/generate``) and to off for chat (the template writes BOS), as vLLM; ``n > 1`` with a ``seed``
gives choice ``i`` the seed ``seed + i``; unknown fields of the OpenAI and native requests are
ignored, as OpenAI does, but control endpoints (``ControlRequest``: ``/update_weights_from_disk``,
``/abort_request``, ...) reject them with a 400 naming the field, so a misspelt key is never
silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

MAX_TOP_LOGPROBS = 20
MAX_N = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    # Constrained decoding (entrypoints/structured_output.py): at most one per request.
    response_format: dict[str, Any] | None = None
    regex: str | None = None  # the whole output matches this regular expression (SGLang's field)
    ebnf: str | None = None  # the output is this EBNF grammar's root rule (SGLang's field)

    def sampling_dict(self, max_new_tokens: int | None) -> dict[str, Any]:
        """Keyword arguments for ``SamplingParams`` (only the fields the client set)."""
        out: dict[str, Any] = {"max_new_tokens": max_new_tokens}
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "seed",
        ):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        out["ignore_eos"] = self.ignore_eos
        out["skip_special_tokens"] = self.skip_special_tokens
        return out


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # true is not token id 1
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. Unknown fields are kept (``model_extra``) so that the
    ones that would change the output are refused by name (``refused_fields.py``)."""

    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    logit_bias: dict[str, float] | None = None
    add_generation_prompt: bool = True
    # Leave the final (assistant) message open and continue it (vLLM's and transformers' name).
    continue_final_message: bool = False
    add_special_tokens: bool = False
    # Passed to the chat template (e.g. {"enable_thinking": false}; vLLM's and SGLang's field).
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calling (entrypoints/tool_calls.py): OpenAI's fields, checked there (400s name them).
    tools: list[Any] | None = None
    tool_choice: Any | None = None
    parallel_tool_calls: bool = True


class GenerateRequest(BaseModel):
    """``POST /generate`` (SGLang's native API): text or input ids, ``sampling_params``, stream."""

    model_config = ConfigDict(extra="ignore")

    text: str | None = None
    input_ids: list[StrictInt] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    logprob_start_len: int = Field(-1, ge=-1)
    rid: str | None = None
    lora_path: str | None = None  # name of a loaded LoRA adapter (SGLang's field name)
    input_embeds: list[list[float]] | None = None  # (T, hidden_size) instead of text / input_ids
    replace_embeds: list[list[float]] | None = None  # (P, hidden_size) at replace_positions
    replace_positions: list[StrictInt] | None = None
    add_special_tokens: bool = (
        True  # text only: the tokenizer's own special tokens (SGLang encodes so)
    )


class ControlRequest(BaseModel):
    """Body of a control endpoint: an unknown key is a 400 naming it (never silently dropped)."""

    model_config = ConfigDict(extra="forbid")


class UpdateWeightsRequest(ControlRequest):
    """``POST /update_weights_from_disk`` (DESIGN 2.4)."""

    model_path: str = Field(..., min_length=1)
    load_format: str | None = None
    revision: str | None = None
    recapture_cuda_graph: bool = True
    abort_all_requests: bool = False
    cuda_graph_max_bs: int | None = Field(None, ge=1, le=4096)
    disable_cuda_graph: bool | None = None
    weight_version: str | None = Field(None, min_length=1, max_length=256)
    flush_cache: bool = True
    # the draft model's new checkpoint (--speculative-algorithm STANDALONE): loaded with the
    # target's, all or nothing
    draft_model_path: str | None = Field(None, min_length=1)
    # seconds new requests are still admitted (and served on the old weights) while the new
    # ones stage; held from then on (0: at once). An operator taking the leader out of routing
    # passes what is left of its gateway settle here.
    admit_seconds: float = Field(0.0, ge=0.0, le=30.0)
    # /ready stays 200 while this update runs (unless unhealthy, draining or blocked): for a
    # caller that already routed traffic away from this server (an operator taking the leader
    # out of routing), so readiness does not flap and the update's end is its reply.
    keep_ready: bool = False


class AbortRequest(ControlRequest):
    """``POST /abort_request``: one ``rid``, or every request with ``abort_all``."""

    rid: str | None = None
    abort_all: bool = False
