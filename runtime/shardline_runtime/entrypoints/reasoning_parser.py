"""``--reasoning-parser``: a reasoning model's ``<think>...</think>`` -> ``reasoning_content``.

- ``qwen3``: thinking is a reply that starts with ``<think>`` (leading whitespace allowed), up
  to ``</think>``; a reply that does not start so is all content (Qwen3 with
  ``chat_template_kwargs: {"enable_thinking": false}``, whose template closes an empty think
  block in the prompt). SGLang's ``qwen3`` detector.
- ``deepseek-r1``: the reply starts inside thinking (the template opened it in the prompt; a
  leading ``<think>`` is dropped) up to ``</think>``; a reply without ``</think>`` is all
  thinking (cut by ``max_tokens``). SGLang's and vLLM's ``deepseek_r1``; also for Qwen3
  thinking-only models.

The tags themselves are in neither part; the text between and after is kept as written.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardline_runtime.entrypoints.tool_parsers import partial_marker_length

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("qwen3", "deepseek-r1")


@dataclass(frozen=True)
class ReasoningSplit:
    """A reply (or a prefix of one): ``reasoning`` and ``content`` as far as they are sure
    (each a prefix of its final value)."""

    reasoning: str
    content: str


def split_reasoning(parser: str, text: str, final: bool) -> ReasoningSplit:
    """Split ``text`` by ``parser`` (:data:`REASONING_PARSERS`); ``final``: ``text`` is the
    whole reply, else a tail that may still become a tag is held back.

    Raises:
        ValueError: an unknown parser.
    """
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser must be one of {REASONING_PARSERS}, got {parser!r}")
    lead = len(text) - len(text.lstrip())
    rest = text[lead:]
    if rest.startswith(THINK_START):
        body = lead + len(THINK_START)
    elif not final and THINK_START.startswith(rest):
        return ReasoningSplit("", "")  # may still open a think block
    elif parser == "qwen3":
        return ReasoningSplit("", text)
    else:
        body = 0
    end = text.find(THINK_END, body)
    if end >= 0:
        return ReasoningSplit(text[body:end], text[end + len(THINK_END) :])
    thinking = text[body:]
    if not final:
        thinking = thinking[: len(thinking) - partial_marker_length(thinking, THINK_END)]
    return ReasoningSplit(thinking, "")
