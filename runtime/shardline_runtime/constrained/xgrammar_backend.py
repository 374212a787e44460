"""The grammar library behind one small interface: xgrammar (what SGLang and vLLM default to).

:class:`GrammarBackend` compiles a :class:`GrammarSpec` against the model's tokenizer (compiled
grammars are cached per spec: the last ``CACHE_SIZE`` specs, keyed by kind, text and
``strict``) and makes a :class:`RequestGrammar` per request: the matcher that fills
the request's row of the token bitmask and is advanced with each accepted token.

Choices, documented in docs/api.md:
- JSON is generated without free whitespace (``any_whitespace=False``: one space after ``:`` and
  ``,``), so a model cannot spend its tokens on blanks (vLLM's ``disable-any-whitespace``).
- ``json_object`` is the schema ``{"type": "object"}`` (an object, as OpenAI's JSON mode).
- The stop tokens are the model's EOS ids: once the grammar is complete only they are allowed.
- A string with ``minLength`` / ``maxLength`` and no ``pattern`` is compiled as the pattern
  ``[^\x00-\x1f"\\]{min,max}``: xgrammar 0.2.9 lets such strings hold raw control characters,
  which JSON forbids (Python's ``json.loads`` refuses them), so the bounded form excludes them.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from shardline_runtime.constrained.grammar_spec import GrammarError, GrammarSpec

BITS_PER_WORD = 32
CACHE_SIZE = 256


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row for ``vocab_size`` tokens (bit ``t % 32`` of word ``t // 32``
    allows token ``t``; xgrammar's layout)."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allow_all_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """(batch_size, bitmask_width) int32, every bit set (every token allowed), on the CPU."""
    return torch.full((batch_size, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of disallowed tokens to ``-inf``, in place (xgrammar's kernel: its C++
    loop on the CPU, its CUDA/Triton kernel on the GPU; about 5x faster than the same in torch
    element-wise ops on the CPU, measured in ``bench/structured.py``'s write-up).

    Args:
        logits: (bs, V) float32 logits; columns past ``32 * width`` (TP padding, which the
            sampler drops) are left alone.
        bitmask: (bs, width) int32 (:func:`bitmask_width`), moved to the logits' device.

    Returns:
        ``logits``.

    Raises:
        ValueError: the row counts differ.
    """
    import xgrammar

    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(
            f"bitmask of shape {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}"
        )
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
    return logits


class RequestGrammar:
    """One request's matcher: which tokens may come next, advanced with each accepted token.

    Built by :meth:`GrammarBackend.matcher`; lives beside the request (``Req.grammar``).
    """

    def __init__(self, matcher: Any):
        self._matcher = matcher
        self.failed = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` ((bs, width) int32, CPU)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance with ``token_id``; False (and ``failed`` set) when the grammar refuses it,
        which a masked step never produces (kept as a guard, e.g. a stop token outside EOS)."""
        if self.failed or self._matcher.is_terminated():
            return True
        ok = bool(self._matcher.accept_token(int(token_id)))
        self.failed = not ok
        return ok

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return bool(self._matcher.is_terminated())


class GrammarBackend:
    """Compiles specs for one tokenizer and vocabulary.

    Args:
        tokenizer: the model's HuggingFace tokenizer.
        vocab_size: the model's vocabulary (logit columns; may exceed the tokenizer's).
        stop_token_ids: ids that end a complete output (the model's EOS ids); empty: the
            tokenizer's own EOS.
        max_threads: compiler threads.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int] = (),
        max_threads: int = 2,
    ):
        import xgrammar

        self._xgr = xgrammar
        stops = list(stop_token_ids) or None
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stops
        )
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stops
        self._compiler = xgrammar.GrammarCompiler(
            info, max_threads=max_threads, cache_enabled=False
        )
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self._cache_lock = threading.Lock()  # the HTTP process compiles in worker threads

    @classmethod
    def from_tokenizer_path(
        cls, path: str, vocab_size: int, stop_token_ids: Sequence[int] = ()
    ) -> GrammarBackend:
        """Load the tokenizer at ``path`` (a directory) and build the backend."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), vocab_size, stop_token_ids)

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of ``spec`` (cached per spec, least recently used out first).

        Raises:
            GrammarError: the library rejects the schema, regex or grammar (names ``spec.param``).
        """
        key = (spec.kind, spec.source, spec.strict)
        with self._cache_lock:
            compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._compile(spec)  # outside the lock: compiles run in parallel
        with self._cache_lock:
            if key not in self._cache and len(self._cache) >= CACHE_SIZE:
                self._cache.popitem(last=False)
            self._cache[key] = compiled
            self._cache.move_to_end(key)
        return compiled

    def _compile(self, spec: GrammarSpec) -> Any:
        try:
            if spec.kind == "json_schema":
                schema = bounded_strings_without_control_characters(json.loads(spec.source))
                return self._compiler.compile_json_schema(
                    json.dumps(schema), any_whitespace=False, strict_mode=spec.strict
                )
            if spec.kind == "json_object":
                return self._compiler.compile_json_schema(
                    json.dumps({"type": "object"}), any_whitespace=False, strict_mode=False
                )
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.source)
            if spec.kind == "structural_tag":
                return self._compiler.compile_structural_tag(spec.source)
            return self._compiler.compile_grammar(spec.source)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(
                f"{spec.param}: the {spec.kind} was rejected: {_first_line(exc)}", spec.param
            ) from None

    def matcher(self, spec: GrammarSpec) -> RequestGrammar:
        """A fresh matcher for one request.

        Raises:
            GrammarError: as :meth:`compile`.
        """
        compiled = self.compile(spec)
        return RequestGrammar(
            self._xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids)
        )


def bounded_strings_without_control_characters(schema: Any) -> Any:
    """``schema`` with every ``{"type": "string", "minLength"?, "maxLength"?}`` that has no
    ``pattern`` or ``format`` rewritten to the equivalent ``pattern`` without control
    characters (see the module docstring); everything else unchanged (a new object)."""
    # Plain loops, no comprehensions: one Python frame per level of nesting (a comprehension
    # adds a second), so a request at the HTTP depth limit never meets RecursionError.
    if isinstance(schema, list):
        items = []
        for item in schema:
            items.append(bounded_strings_without_control_characters(item))
        return items
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        out[key] = bounded_strings_without_control_characters(value)
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out:
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{low},{high}}}$'
    return out


def _first_line(exc: Exception) -> str:
    """The library's message without its C++ source location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    # "[02:26:59] /project/cpp/json_schema_converter.cc:5082: Unsupported type ..."
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    return text


class LazyGrammars:
    """``spec -> RequestGrammar``, building the :class:`GrammarBackend` (tokenizer load, vocabulary
    scan) at the first constrained request, so a server that never sees one never pays for it.

    Args:
        tokenizer_path: the tokenizer directory (``--tokenizer-path``, default the model's).
        vocab_size / stop_token_ids: as :class:`GrammarBackend`.
    """

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: Sequence[int]):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._backend: GrammarBackend | None = None
        self._build_lock = threading.Lock()  # compiles run in the scheduler's worker threads

    @property
    def backend(self) -> GrammarBackend:
        with self._build_lock:
            if self._backend is None:
                self._backend = GrammarBackend.from_tokenizer_path(
                    self.tokenizer_path, self.vocab_size, self.stop_token_ids
                )
        return self._backend

    def __call__(self, spec: GrammarSpec) -> RequestGrammar:
        return self.backend.matcher(spec)
