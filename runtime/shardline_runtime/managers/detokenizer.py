"""Incremental detokenization with UTF-8 safety and stop strings across token boundaries.

One :class:`IncrementalDetokenizer` per request (per choice when ``n > 1``), fed the token ids
the scheduler emits step by step. It returns text deltas such that:

- the concatenation of all deltas equals the final text (streamed == non-streamed, because the
  non-streamed path uses this very class and joins the deltas);
- a multi-byte character split over several byte-level tokens is emitted once, whole: a decode
  that ends in U+FFFD is held back until the following tokens complete it (the prefix/read
  offset scheme of vLLM's ``detokenize_incrementally`` and SGLang's detokenizer manager);
- a stop string is matched on the text, wherever token boundaries fall; the text is cut before
  it (or after it with ``include_stop_str_in_output``), and a tail that could still become a stop
  string is held back, so a stream never emits text it would have to retract.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens decoded as left context so the first output tokens get the right spacing
# (SentencePiece-style tokenizers drop a leading space when decoding a lone token); vLLM uses 5.
_INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into safe text deltas.

    Args:
        tokenizer: a HuggingFace tokenizer (``decode(ids, skip_special_tokens=...)``).
        prompt_ids: the prompt's token ids (the last few serve as decoding context).
        stop: stop strings (non-empty).
        skip_special_tokens: passed to ``decode``.
        include_stop_str_in_output: keep the matched stop string in the text.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ):
        self._tokenizer = tokenizer
        context = list(prompt_ids[-_INITIAL_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._skip = skip_special_tokens
        self._stop = tuple(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop_str_in_output
        self.text = ""  # all decoded output text (after a stop match: cut at it)
        self._emitted = 0  # characters of ``text`` already returned as deltas
        self.num_tokens = 0  # output tokens consumed (up to and including a stop match)
        # Per consumed token: where its text starts in ``text`` (see :meth:`_offset`).
        self.token_offsets: list[int] = []
        self.matched_stop: str | None = None

    @property
    def stopped(self) -> bool:
        """True once a stop string matched; further tokens are ignored."""
        return self.matched_stop is not None

    def _decode_new(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix = self._tokenizer.decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip
        )
        full = self._tokenizer.decode(
            self._ids[self._prefix_offset :], skip_special_tokens=self._skip
        )
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix) :]
        return ""

    def _offset(self, token_id: int, delta: str, held: str) -> int:
        """Where the token's own text starts, relative to the end of ``text``, when earlier tokens
        were held back (their text so far: ``held``, possibly ending in U+FFFD).

        A token holding bytes of a character split over tokens starts where that character
        does; a whole token after a byte sequence that never became a character (shown as
        U+FFFD) starts after it.
        """
        own = self._tokenizer.decode([token_id], skip_special_tokens=self._skip)
        if own and _REPLACEMENT not in own and delta.endswith(own):
            return len(delta) - len(own)
        return len(held.rstrip(_REPLACEMENT))

    def _pending_bytes_text(self) -> str:
        """Text of tokens held back for an incomplete character (flushed at the end)."""
        prefix = self._tokenizer.decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip
        )
        full = self._tokenizer.decode(
            self._ids[self._prefix_offset :], skip_special_tokens=self._skip
        )
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _check_stop(self, old_len: int) -> None:
        if not self._stop:
            return
        start = max(0, old_len - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s)] if self._include_stop else self.text[:i]
            self.matched_stop = s

    def _safe_end(self) -> int:
        """End of the text that can be emitted: hold back a tail that may begin a stop string."""
        if self.stopped or not self._stop:
            return len(self.text)
        for k in range(min(self._max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return len(self.text) - k
        return len(self.text)

    def add_tokens(self, token_ids: Sequence[int], exclude_last: bool = False) -> str:
        """Consume new output tokens and return the text delta now safe to emit.

        Args:
            token_ids: new token ids in order.
            exclude_last: the last id is a stop token (EOS or a ``stop_token_ids`` entry) whose
                text is not part of the output; it still counts in ``num_tokens``.
        """
        first = len(self.token_offsets)
        for j, token_id in enumerate(token_ids):
            if self.stopped:
                break
            self.num_tokens += 1
            if exclude_last and j == len(token_ids) - 1:
                self.token_offsets.append(len(self.text))
                break
            old_len = len(self.text)
            held = self._pending_bytes_text() if len(self._ids) > self._read_offset else None
            delta = self._decode_new(int(token_id))
            self.token_offsets.append(
                old_len + (self._offset(int(token_id), delta, held) if held is not None else 0)
            )
            self.text += delta
            self._check_stop(old_len)
        if self.stopped:  # tokens inside a cut stop string start at the end of the text
            for k in range(first, len(self.token_offsets)):
                self.token_offsets[k] = min(self.token_offsets[k], len(self.text))
        return self._take(self._safe_end())

    def finish(self) -> str:
        """The request ended (not by a stop string): flush held-back text and return it."""
        if not self.stopped:
            old_len = len(self.text)
            self.text += self._pending_bytes_text()
            self._check_stop(old_len)
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
