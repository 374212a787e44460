"""Request bodies of the HTTP API (pydantic), OpenAI's field names and defaults.

Ranges that pydantic checks here produce a 400 naming the field; the sampling ranges
(temperature, top_p, top_k, min_p, penalties, seed) are checked once, by ``SamplingParams``.
Documented choices (docs/api.md): ``max_tokens: 0`` is accepted on ``/v1/completions`` with
``echo: true`` only (the prompt is scored, nothing is generated: how lm-evaluation-harness asks
for loglikelihoods), a 400 otherwise; ``/generate`` accepts ``max_new_tokens: 0``;
``add_special_tokens`` defaults to the tokenizer's own behaviour for text prompts (completions,
``/generate``) and to off for chat (the template writes BOS), as vLLM; ``n > 1`` with a ``seed``
gives choice ``i`` the seed ``seed + i``; unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt

MAX_TOP_LOGPROBS = 20
MAX_N = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: Optional[str] = None

    def sampling_dict(self, max_new_tokens: int | None) -> dict[str, Any]:
        """Keyword arguments for ``SamplingParams`` (only the fields the client set)."""
        out: dict[str, Any] = {"max_new_tokens": max_new_tokens}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "seed"):
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

    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]  # true is not token id 1
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: Optional[int] = None
    logit_bias: Optional[dict[str, float]] = None
    suffix: Optional[str] = None
    add_special_tokens: bool = True


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    logit_bias: Optional[dict[str, float]] = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    # Not supported: a request that sets them gets a 400 instead of silently free text.
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None


class GenerateRequest(BaseModel):
    """``POST /generate`` (SGLang's native API): text or input ids, ``sampling_params``, stream."""

    model_config = ConfigDict(extra="ignore")

    text: Optional[str] = None
    input_ids: Optional[list[StrictInt]] = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    logprob_start_len: int = Field(-1, ge=-1)
    rid: Optional[str] = None
    lora_path: Optional[str] = None  # name of a loaded LoRA adapter (SGLang's field name)
    input_embeds: Optional[list[list[float]]] = None  # (T, hidden_size) instead of text / input_ids
    replace_embeds: Optional[list[list[float]]] = None  # (P, hidden_size) at replace_positions
    replace_positions: Optional[list[StrictInt]] = None
    add_special_tokens: bool = True  # text only: the tokenizer's own special tokens (SGLang encodes so)


class UpdateWeightsRequest(BaseModel):
    """``POST /update_weights_from_disk`` (DESIGN 2.4)."""

    model_config = ConfigDict(extra="ignore")

    model_path: str = Field(..., min_length=1)
    load_format: Optional[str] = None
    revision: Optional[str] = None
    recapture_cuda_graph: bool = True
    abort_all_requests: bool = False
    cuda_graph_max_bs: Optional[int] = Field(None, ge=1, le=4096)
    disable_cuda_graph: Optional[bool] = None
    weight_version: Optional[str] = Field(None, min_length=1, max_length=256)
    flush_cache: bool = True


class AbortRequest(BaseModel):
    """``POST /abort_request``: one ``rid``, or every request with ``abort_all``."""

    rid: Optional[str] = None
    abort_all: bool = False
