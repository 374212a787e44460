"""Request validation in the HTTP process: tokenize prompts and check them against the limits
the schedulers reported (:class:`SchedulerInfo`), before anything is sent.

Every failure is a :class:`RequestValidationError` naming the field (HTTP 400).
"""

from __future__ import annotations

import asyncio
from typing import Any

from shardline_runtime.constrained.grammar_spec import GrammarError, GrammarSpec
from shardline_runtime.constrained.xgrammar_backend import GrammarBackend
from shardline_runtime.managers.io_struct import SchedulerInfo


class RequestValidationError(ValueError):
    """A request the client can fix (HTTP 400); ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestValidator:
    """Tokenizes and validates prompts.

    Args:
        tokenizer: HuggingFace tokenizer of the model.
        info: limits from the rank-0 scheduler.
    """

    def __init__(self, tokenizer: Any, info: SchedulerInfo):
        self.tokenizer = tokenizer
        self.info = info
        # The longest token's text: a longer text than this many characters per allowed token
        # is surely over the limit.
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1) + 1
        self._grammars: GrammarBackend | None = None

    def check_grammar(self, spec: GrammarSpec) -> None:
        """Compile ``spec`` (cached per spec; the backend is built at the first one), so a
        schema, regex or grammar the library rejects is a 400 before anything is queued.

        Raises:
            RequestValidationError: the library rejected it (``param`` names the field).
        """
        if self._grammars is None:
            self._grammars = GrammarBackend(
                self.tokenizer, self.info.vocab_size, self.info.eos_token_ids
            )
        try:
            self._grammars.compile(spec)
        except GrammarError as exc:
            raise RequestValidationError(str(exc), exc.param) from None

    async def compile_grammar(self, spec: GrammarSpec | None) -> None:
        """:meth:`check_grammar` in a worker thread (None: nothing to do). Compiling a deep or
        large schema takes seconds; xgrammar releases the GIL meanwhile, so the event loop keeps
        answering ``/health`` and other requests. The compiled grammar is cached, so the
        synchronous check that follows is a lookup.

        Raises:
            RequestValidationError: the library rejected it (``param`` names the field).
        """
        if spec is not None:
            await asyncio.to_thread(self.check_grammar, spec)

    def encode_text(self, text: str, add_special_tokens: bool) -> tuple[list[int], int]:
        """Token ids of ``text`` and how many of them the tokenizer added in front of it.

        ``add_special_tokens=True`` applies the tokenizer's own post-processor (a Llama-style
        tokenizer prepends BOS), as vLLM and SGLang do for text prompts; a text that already
        starts with the BOS token gets no second one (vLLM drops the duplicate the same way).
        """
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not add_special_tokens:
            return ids, 0
        full = self.tokenizer.encode(text, add_special_tokens=True)
        added = next(
            (k for k in range(len(full) - len(ids) + 1) if full[k : k + len(ids)] == ids), 0
        )
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if added and bos is not None and ids and ids[0] == bos and full[added - 1] == bos:
            full = full[: added - 1] + full[added:]
            added -= 1
        return full, added

    def tokenize(
        self, prompt: str | list[int], param: str = "prompt", add_special_tokens: bool = False
    ) -> list[int]:
        """Token ids of ``prompt`` (a string, or ids checked against the vocabulary).

        ``add_special_tokens`` applies to a string only (see :meth:`encode_text`); token ids are
        sent as given.

        Raises:
            RequestValidationError: empty prompt, or an id outside ``[0, vocab_size)``.
        """
        if isinstance(prompt, str):
            self.check_text_length(prompt, param)
            ids, _ = self.encode_text(prompt, add_special_tokens)
        else:
            ids = list(prompt)
            bad = [
                t
                for t in ids
                if not isinstance(t, int)
                or isinstance(t, bool)
                or not 0 <= t < self.info.vocab_size
            ]
            if bad:
                raise RequestValidationError(
                    f"{param} token ids must be integers in [0, {self.info.vocab_size}), got {bad[0]!r}",
                    param,
                )
        if not ids:
            raise RequestValidationError(f"{param} must contain at least one token", param)
        return ids

    def check_text_length(self, text: str, param: str) -> None:
        """Reject an empty text, and one surely over the prompt limit without tokenizing it.

        Raises:
            RequestValidationError: ``text`` is empty or too long.
        """
        if text == "":
            raise RequestValidationError(f"{param} must not be empty", param)
        # A token covers at most ``_max_token_chars`` characters, so a longer text is surely
        # over the limit: reject it without tokenizing (which would block the event loop).
        if len(text) > self.max_token_chars * self.info.max_req_input_len:
            raise RequestValidationError(
                f"{param} has {len(text)} characters: more than the {self.info.max_req_input_len} tokens "
                "this server accepts",
                param,
            )

    def check_lengths(self, input_ids: list[int], max_new_tokens: int | None) -> int:
        """Validate prompt length and ``max_tokens`` against the context; return max_new_tokens.

        ``None`` means "as many as fit in the context". The KV pool (not the context) may clip
        a request further; it then ends with ``finish_reason: "length"``.

        Raises:
            RequestValidationError: the prompt or prompt + ``max_tokens`` exceed the limits.
        """
        n = len(input_ids)
        limit = self.info.max_req_input_len
        if n > limit:
            raise RequestValidationError(
                f"the prompt has {n} tokens but this server accepts at most {limit} prompt tokens "
                f"(context length {self.info.context_len}, KV pool {self.info.max_total_num_tokens} tokens)",
                "prompt",
            )
        # As SGLang: prompt + output must stay below the context length (max_req_len).
        limit_total = self.info.context_len - 1
        room = limit_total - n
        if max_new_tokens is None:
            return room
        if n + max_new_tokens > limit_total:
            raise RequestValidationError(
                f"the prompt has {n} tokens and max_tokens is {max_new_tokens}: {n + max_new_tokens} "
                f"exceeds {limit_total} (context length {self.info.context_len} - 1); ask for at most {room} tokens",
                "max_tokens",
            )
        return max_new_tokens
