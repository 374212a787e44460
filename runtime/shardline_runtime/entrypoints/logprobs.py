"""OpenAI ``logprobs`` objects of completions and chat, built from the scheduler's
:class:`TokenLogprob` entries.

Completions (legacy OpenAI format, as vLLM): ``{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}``, one entry per token. With ``echo`` and ``logprobs`` the prompt's tokens come
first: the first prompt token has no logprob (``null``, and ``null`` top logprobs, as vLLM and
OpenAI), then one entry per completion token. ``text_offset`` is the character offset of each
token's text in the returned ``text`` (echoed prompt + completion); a token that completes a
character split over several byte-level tokens starts where that character starts, so the
offsets never point past the text nor inside a character.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`` (completion tokens only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardline_runtime.managers.detokenizer import IncrementalDetokenizer
from shardline_runtime.managers.io_struct import TokenLogprob
from shardline_runtime.managers.tokenizer_manager import TokenizerManager


def _top_dict(texts: Mapping[int, str], top: list[tuple[float, int]]) -> dict[str, float]:
    best: dict[str, float] = {}
    for v, t in top:  # tokens with the same text (e.g. partial UTF-8 bytes) share one key
        key = texts[t]
        best[key] = max(v, best.get(key, v))
    return best


def completion_logprobs(
    texts: Mapping[int, str], entries: list[TokenLogprob], offsets: list[int], base: int
) -> dict[str, list]:
    """Legacy completions ``logprobs`` of ``entries``; ``offsets[k] + base`` is token k's text
    offset; ``texts`` maps every token id (alternatives included) to its text.

    A ``None`` logprob (the first prompt token) gets ``None`` top logprobs.
    """
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for e, offset in zip(entries, offsets):
        out["tokens"].append(texts[e.token_id])
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append(None if e.logprob is None else _top_dict(texts, e.top))
        out["text_offset"].append(base + offset)
    return out


def prompt_text_offsets(
    tm: TokenizerManager, input_ids: list[int], added_prefix: int, echo_text: str
) -> list[int]:
    """Character offset of each prompt token in ``echo_text``.

    ``added_prefix`` tokens the tokenizer put in front of a text prompt (BOS) are not part of the
    echoed text: they sit at offset 0 with no width. The rest are decoded incrementally
    (special tokens kept, as the echoed text of a token-id prompt keeps them).
    """
    detok = IncrementalDetokenizer(tm.tokenizer, [], skip_special_tokens=False)
    detok.add_tokens(input_ids[added_prefix:])
    return [0] * added_prefix + [min(o, len(echo_text)) for o in detok.token_offsets]


def _token_bytes(tm: TokenizerManager, token_id: int, text: str) -> list[int]:
    """The token's own bytes (a partial UTF-8 byte token is not U+FFFD's bytes)."""
    backend = getattr(tm.tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend.decoder).__name__ == "ByteLevel":
        piece = tm.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and all(ch in _BYTE_DECODER for ch in piece):
            return [_BYTE_DECODER[ch] for ch in piece]
    return list(text.encode("utf-8"))


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: the printable character each byte-level BPE
    vocabulary uses for a byte -> that byte (Radford et al. 2019, used by every ByteLevel tokenizer)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _gpt2_byte_decoder()


def chat_logprobs(
    tm: TokenizerManager, texts: Mapping[int, str], entries: list[TokenLogprob]
) -> dict[str, list]:
    """Chat ``logprobs``: ``{"content": [...]}`` with each token's text (from ``texts``),
    logprob, bytes and top."""

    def entry(lp: float | None, tid: int) -> dict[str, Any]:
        text = texts[tid]
        return {"token": text, "logprob": lp, "bytes": _token_bytes(tm, tid, text)}

    return {
        "content": [
            dict(entry(e.logprob, e.token_id), top_logprobs=[entry(v, t) for v, t in e.top])
            for e in entries
        ]
    }


def merge_logprobs(acc: dict | None, new: dict) -> dict:
    """Append the lists of ``new`` to those of ``acc`` (either format)."""
    if acc is None:
        return new
    for key, value in new.items():
        acc[key] = acc[key] + value
    return acc
