"""The speculative-decoding section of the server arguments and its flags (SGLang's names).

``--speculative-algorithm``: ``NGRAM`` (prompt lookup: drafts are copied from the request's own
tokens) and ``STANDALONE`` (a small draft model of the target's tokenizer,
``--speculative-draft-model-path``, run by its own runner and KV pool) and ``EAGLE`` (an
EAGLE head checkpoint, ``architectures: ["LlamaForCausalLMEagle"]``, fed the target's hidden
states) and ``EAGLE3`` (an EAGLE-3 head, ``architectures: ["LlamaForCausalLMEagle3"]``, fed
three of the target's layers, with its own draft vocabulary) are implemented.
``--speculative-num-steps`` is implied by the draft-token count (one draft forward per
draft token in a chain). ``--speculative-num-draft-tokens`` counts the tokens one
verify forward scores per request, the last accepted token included (SGLang's convention), so
a request gets at most ``num_draft_tokens - 1`` draft tokens a step. ``--speculative-eagle-topk``
1 is a chain; tree verification (top-k > 1) is refused.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")
IMPLEMENTED_ALGORITHMS = SPECULATIVE_ALGORITHMS
DRAFT_MODEL_ALGORITHMS = ("STANDALONE", "EAGLE", "EAGLE3")
DEFAULT_NUM_STEPS = 4


@dataclass(frozen=True)
class SpeculativeArgs:
    """Speculative decoding (off when ``speculative_algorithm`` is None).

    Attributes:
        speculative_algorithm: one of ``SPECULATIVE_ALGORITHMS`` or None.
        speculative_draft_model_path: the draft checkpoint (STANDALONE / EAGLE).
        speculative_num_steps: draft steps per verify (resolved: ``num_draft_tokens - 1``).
        speculative_num_draft_tokens: tokens scored per request by one verify forward, the
            last accepted one included (resolved: ``num_steps + 1``).
        speculative_eagle_topk: branches per draft step; 1 is a chain.
        speculative_ngram_min_match_window_size / ..._max_...: n-gram lengths (tokens) the
            NGRAM proposer looks up, longest first.
    """

    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_eagle_topk: int = 1
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12

    @classmethod
    def resolve(cls, **values: Any) -> SpeculativeArgs:
        """Fill ``num_steps`` / ``num_draft_tokens`` from each other (default 4 steps) when an
        algorithm is set."""
        if values.get("speculative_algorithm"):
            steps, tokens = (
                values.get("speculative_num_steps"),
                values.get("speculative_num_draft_tokens"),
            )
            if tokens is None:
                tokens = (steps or DEFAULT_NUM_STEPS) + 1
            values["speculative_num_draft_tokens"] = tokens
            values["speculative_num_steps"] = steps if steps is not None else tokens - 1
        return cls(**values)

    @property
    def enabled(self) -> bool:
        return self.speculative_algorithm is not None

    @property
    def max_draft_tokens(self) -> int:
        """Draft tokens per request per step (0 when off)."""
        return (self.speculative_num_draft_tokens or 1) - 1


def speculative_errors(spec: SpeculativeArgs, pp_size: int, lora: bool) -> list[str]:
    """What refuses this combination, as messages naming the flags and allowed values."""
    if not spec.enabled:
        if spec.speculative_draft_model_path:
            return [
                "--speculative-draft-model-path needs --speculative-algorithm STANDALONE, EAGLE "
                "or EAGLE3"
            ]
        return []
    algo, errors = spec.speculative_algorithm, []
    if algo not in IMPLEMENTED_ALGORITHMS:
        errors.append(
            f"--speculative-algorithm {algo} is not implemented yet; implemented: "
            f"{', '.join(IMPLEMENTED_ALGORITHMS)}"
        )
    needs_draft = algo in DRAFT_MODEL_ALGORITHMS
    if needs_draft and not spec.speculative_draft_model_path:
        errors.append(f"--speculative-algorithm {algo} needs --speculative-draft-model-path")
    if not needs_draft and spec.speculative_draft_model_path:
        errors.append(
            f"--speculative-draft-model-path is not used by --speculative-algorithm {algo}; "
            f"drop it or use one of {', '.join(DRAFT_MODEL_ALGORITHMS)}"
        )
    if spec.speculative_eagle_topk != 1:
        errors.append(
            f"--speculative-eagle-topk {spec.speculative_eagle_topk}: only 1 (chain verification) "
            "is implemented"
        )
    if spec.max_draft_tokens < 1:
        errors.append(
            f"--speculative-num-draft-tokens must be >= 2 (the last token plus at least one draft), "
            f"got {spec.speculative_num_draft_tokens}"
        )
    steps, tokens = spec.speculative_num_steps, spec.speculative_num_draft_tokens
    if spec.speculative_eagle_topk == 1 and steps is not None and tokens is not None:
        if steps != tokens - 1:
            errors.append(
                f"--speculative-num-steps {steps} and --speculative-num-draft-tokens {tokens}: a "
                "chain (--speculative-eagle-topk 1) drafts one token per step, so "
                "num-draft-tokens must be num-steps + 1"
            )
    lo, hi = (
        spec.speculative_ngram_min_match_window_size,
        spec.speculative_ngram_max_match_window_size,
    )
    if not 1 <= lo <= hi:
        errors.append(
            "--speculative-ngram-min-match-window-size must be in [1, "
            f"--speculative-ngram-max-match-window-size], got {lo} and {hi}"
        )
    if pp_size > 1:
        errors.append(
            "--speculative-algorithm is not supported with --pp-size > 1; use --pp-size 1"
        )
    if lora:
        errors.append(
            "--speculative-algorithm is not supported with --enable-lora / --lora-paths yet"
        )
    return errors


def add_speculative_flags(
    p: argparse.ArgumentParser, int_range: Callable[..., Callable[[str], int]]
) -> None:
    """The ``speculative decoding`` flag group; ``int_range(flag, low)`` makes a range check."""
    s = p.add_argument_group("speculative decoding")
    s.add_argument(
        "--speculative-algorithm",
        choices=SPECULATIVE_ALGORITHMS,
        default=None,
        help="Speculative decoding: NGRAM (prompt lookup, no draft model), STANDALONE (a "
        "draft model of the same tokenizer, --speculative-draft-model-path), EAGLE (an EAGLE "
        "head checkpoint fed the target's hidden states) and EAGLE3 (an EAGLE-3 head fed three "
        "of the target's layers, with its own draft vocabulary). Turns the overlap "
        "scheduler off (a verify step's accepted length decides the next step's inputs).",
    )
    s.add_argument(
        "--speculative-draft-model-path",
        default=None,
        help="Draft checkpoint: a directory, hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX "
        "(fetched into --download-dir like --model-path); a causal LM with the target's "
        "vocabulary (STANDALONE), or an EAGLE head, architectures LlamaForCausalLMEagle (EAGLE) "
        "or LlamaForCausalLMEagle3 (EAGLE3).",
    )
    s.add_argument(
        "--speculative-num-steps",
        type=int_range("--speculative-num-steps", 1),
        default=None,
        help=f"Draft steps per verify (default: num-draft-tokens - 1, else {DEFAULT_NUM_STEPS}).",
    )
    s.add_argument(
        "--speculative-num-draft-tokens",
        type=int_range("--speculative-num-draft-tokens", 2),
        default=None,
        help="Tokens one verify forward scores per request, the last accepted token included "
        "(default: num-steps + 1).",
    )
    s.add_argument(
        "--speculative-eagle-topk",
        type=int_range("--speculative-eagle-topk", 1),
        default=1,
        help="Branches per draft step; 1 (chain) is implemented.",
    )
    for bound, default in (("min", 1), ("max", 12)):
        flag = f"--speculative-ngram-{bound}-match-window-size"
        s.add_argument(
            flag,
            type=int_range(flag, 1),
            default=default,
            help=f"NGRAM: the {'shortest' if bound == 'min' else 'longest'} suffix (tokens) "
            "looked up earlier in the request.",
        )
