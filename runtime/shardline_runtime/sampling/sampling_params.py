"""Per-request sampling parameters, validated at construction.

Field names and ranges follow the OpenAI API and vLLM/SGLang where they agree. A bad value raises
:class:`SamplingParamsError` (a ``ValueError``) whose message names the field, the value and the
allowed range, so the HTTP layer can turn it into a 400 without knowing the rules.

Edge cases (field case R4), chosen once and documented here:

- ``temperature == 0`` means greedy (argmax), whatever ``top_k`` / ``top_p`` / ``min_p`` say.
- ``top_k`` of ``-1`` or ``0`` disables top-k; a value above the vocabulary is clamped to it.
- ``top_p == 0`` is accepted and means greedy (keeping "the smallest set whose mass reaches 0" is
  the single most likely token); it never produces NaN.
- ``max_new_tokens == 0`` is a prefill-only request: no token is sampled (prompt logprobs only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

SAMPLING_EPS = 1e-5
_MAX_SEED = 2**63 - 1


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; ``field`` names it (e.g. ``"top_p"``)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingParamsError(name, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise SamplingParamsError(name, f"must be finite, got {value!r}")
    return float(value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(name, f"must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request.

    Attributes:
        max_new_tokens: tokens to generate, >= 0 (0: prefill only). ``None`` means "up to the
            context limit" (the scheduler fills it in).
        temperature: >= 0; below 1e-5 (``SAMPLING_EPS``) is greedy.
        top_p: nucleus mass in [0, 1]; 0 is greedy, 1 disables.
        top_k: -1 or 0 disables, else >= 1 (clamped to the vocabulary size).
        min_p: in [0, 1]; drop tokens with prob < min_p * max prob (0 disables).
        repetition_penalty: > 0 (1 disables); divides positive / multiplies negative logits of
            every token seen in the prompt or the output (CTRL, Keskar et al. 2019; as vLLM).
        frequency_penalty: in [-2, 2]; subtracts ``penalty * count`` of each output token.
        presence_penalty: in [-2, 2]; subtracts ``penalty`` once from each output token.
        stop_token_ids: extra token ids that end the request (the stop token is kept in the output).
        stop: stop strings, matched by the detokenizer (not by the sampler).
        ignore_eos: do not stop at the model's EOS token.
        skip_special_tokens: for detokenization.
        seed: in [0, 2**63 - 1]; a seeded request draws from its own ``torch.Generator``, so it
            gives the same tokens alone or batched with others.

    Raises:
        SamplingParamsError: any field out of range (message names the field and the range).
    """

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None and _integer("max_new_tokens", self.max_new_tokens) < 0:
            raise SamplingParamsError("max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
        if _number("temperature", self.temperature) < 0:
            raise SamplingParamsError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 <= _number("top_p", self.top_p) <= 1.0:
            raise SamplingParamsError("top_p", f"must be in [0, 1], got {self.top_p}")
        if _integer("top_k", self.top_k) < -1:
            raise SamplingParamsError(
                "top_k", f"must be -1 or 0 (disabled) or >= 1, got {self.top_k}"
            )
        if not 0.0 <= _number("min_p", self.min_p) <= 1.0:
            raise SamplingParamsError("min_p", f"must be in [0, 1], got {self.min_p}")
        if _number("repetition_penalty", self.repetition_penalty) <= 0:
            raise SamplingParamsError(
                "repetition_penalty", f"must be > 0 (1 disables), got {self.repetition_penalty}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= _number(name, getattr(self, name)) <= 2.0:
                raise SamplingParamsError(name, f"must be in [-2, 2], got {getattr(self, name)}")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise SamplingParamsError("stop_token_ids", f"must be a list of integers, got {ids!r}")
        for token_id in ids:
            if _integer("stop_token_ids", token_id) < 0:
                raise SamplingParamsError("stop_token_ids", f"must be >= 0, got {token_id}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise SamplingParamsError(
                "stop", f"must be a list of non-empty strings, got {self.stop!r}"
            )
        object.__setattr__(self, "stop", tuple(stop))
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(
                    name, f"must be true or false, got {getattr(self, name)!r}"
                )
        if self.seed is not None and not 0 <= _integer("seed", self.seed) <= _MAX_SEED:
            raise SamplingParamsError("seed", f"must be in [0, 2**63 - 1], got {self.seed}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a JSON-like dict; unknown keys raise ``SamplingParamsError`` naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise SamplingParamsError(
                unknown[0], f"unknown sampling parameter; allowed: {sorted(known)}"
            )
        return cls(**values)

    def verify_vocab(self, vocab_size: int) -> None:
        """Check the token ids against the model vocabulary.

        Raises:
            SamplingParamsError: a stop token id is >= ``vocab_size``.
        """
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise SamplingParamsError(
                    "stop_token_ids", f"{token_id} is outside the vocabulary [0, {vocab_size})"
                )

    @property
    def is_greedy(self) -> bool:
        """True when the sampler takes the argmax (temperature below ``SAMPLING_EPS``, top_k 1
        or top_p 0).

        A positive temperature below ``SAMPLING_EPS`` (1e-5, vLLM's threshold) is greedy: it is
        argmax in the limit, and dividing float32 logits by it overflows (1e-45 is 0 in float32).
        """
        return self.temperature < SAMPLING_EPS or self.top_k == 1 or self.top_p == 0.0

    def effective_top_k(self, vocab_size: int) -> int:
        """``top_k`` with "disabled" (-1, 0) and values above the vocabulary mapped to ``vocab_size``."""
        return vocab_size if self.top_k <= 0 else min(self.top_k, vocab_size)

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )
