"""Tool-call formats of model families: where a reply's calls are, read whole or as a prefix.

One :class:`ToolCallFormat` record per family (``--tool-call-parser``) says what text surrounds
each call; the same record builds the grammar that forces calls (``tool_calls.py``) and parses
replies, so what the grammar makes the parser reads. Every family writes a call as the JSON
object ``{"name": NAME, KEY: ARGUMENTS}`` (``KEY`` is ``arguments`` or ``parameters``; both
are read):

- ``llama3``: Llama 3.1+ JSON tool calling: the reply *is* the calls, ``{"name": ...,
  "parameters": {...}}``, several separated by ``;``, optionally after ``<|python_tag|>``
  (vLLM's ``llama3_json``); a reply that does not start so is plain content.
- ``hermes`` (alias ``qwen``): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call, anywhere in the reply (NousResearch Hermes 2 Pro, the Qwen2.5 and Qwen3
  templates; vLLM's ``hermes``, SGLang's ``qwen25``).
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral's v3 tokenizer
  format; vLLM's and SGLang's ``mistral``).

Content is the text before the calls; text after them is dropped (vLLM's and SGLang's parsers do
the same). A reply whose calls cannot be read (no call name) is all content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_WS = re.compile(r"\s*")
# The opening of one call object up to its arguments value (name first, as every family writes).
_CALL_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family writes its calls (module docstring).

    Attributes:
        name: the ``--tool-call-parser`` value.
        markers: texts that open the calls section (consumed); ``bare_json`` also opens it at
            a ``{`` that starts the reply.
        anywhere: the section may open after content (hermes, mistral), or only at the
            reply's start (llama3).
        arguments_key: the key the grammar writes for the arguments.
        call_open / call_close: around each call object (hermes' block tags), as the grammar
            writes them; parsing allows any whitespace around their stripped text.
        separator: between calls (stripped for parsing).
        list_open / list_close: around all calls (mistral's JSON array).
    """

    name: str
    markers: tuple[str, ...]
    arguments_key: str
    anywhere: bool = True
    bare_json: bool = False
    call_open: str = ""
    call_close: str = ""
    separator: str = "\n"
    list_open: str = ""
    list_close: str = ""

    def section_prefix(self) -> str:
        """The text the grammar writes before the first call."""
        opens_each_call = self.call_open.strip() == self.markers[0]  # hermes: written per call
        marker = "" if self.bare_json or opens_each_call else self.markers[0]
        return marker + self.list_open


LLAMA3 = ToolCallFormat(
    "llama3", ("<|python_tag|>",), "parameters", anywhere=False, bare_json=True, separator="; "
)
HERMES = ToolCallFormat(
    "hermes", ("<tool_call>",), "arguments", call_open="<tool_call>\n", call_close="\n</tool_call>"
)
MISTRAL = ToolCallFormat(
    "mistral", ("[TOOL_CALLS]",), "arguments", separator=", ", list_open="[", list_close="]"
)
TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    "llama3": LLAMA3,
    "hermes": HERMES,
    "qwen": HERMES,
    "mistral": MISTRAL,
}
# ``--tool-call-parser auto``: config.json's architecture -> family
ARCHITECTURE_FORMATS: dict[str, str] = {
    "LlamaForCausalLM": "llama3",
    "Qwen2ForCausalLM": "hermes",
    "Qwen3ForCausalLM": "hermes",
    "Qwen2MoeForCausalLM": "hermes",
    "Qwen3MoeForCausalLM": "hermes",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mistral",
}
TOOL_CALL_PARSERS = ("auto", *TOOL_CALL_FORMATS)


@dataclass
class ScannedCall:
    """One call as far as the text goes: ``arguments`` is the raw JSON text of the arguments
    (a prefix while ``complete`` is False)."""

    name: str
    arguments: str
    complete: bool


@dataclass
class ScannedReply:
    """A reply (or a prefix of one) split into content and calls.

    Attributes:
        content: the text that is content for sure (a prefix of the final content).
        calls: the calls seen, each named; the last may be incomplete.
    """

    content: str
    calls: list[ScannedCall] = field(default_factory=list)


def scan_reply(fmt: ToolCallFormat, text: str, final: bool) -> ScannedReply:
    """Split ``text`` (the reply so far; ``final``: all of it) into content and calls.

    While not ``final``, text that may still turn out to open a call is held back: it is in
    neither ``content`` nor ``calls``. Both only grow as ``text`` grows, so a stream can send
    their differences. ``final`` with no named call: the whole text is content.
    """
    start, body = _section(fmt, text, final)
    if start is None:
        return ScannedReply(text if final else text[: _safe_end(fmt, text)])
    calls = _scan_calls(fmt, text, body, final)
    if final and not calls:
        return ScannedReply(text)
    return ScannedReply(text[:start], calls)


def _section(fmt: ToolCallFormat, text: str, final: bool) -> tuple[int | None, int]:
    """(where the calls section starts, where its first call starts), or (None, 0)."""
    if not fmt.anywhere:
        lead = len(text) - len(text.lstrip())
        if fmt.bare_json and text.startswith("{", lead):
            return lead, lead
        for marker in fmt.markers:
            if text.startswith(marker, lead):
                return lead, lead + len(marker)
        return None, 0
    found = [(text.find(m), m) for m in fmt.markers if m in text]
    if not found:
        return None, 0
    at, marker = min(found)
    return at, (at if fmt.call_open.strip() == marker else at + len(marker))


def _safe_end(fmt: ToolCallFormat, text: str) -> int:
    """How much of ``text`` (no section yet) is content for sure: all but a tail that may
    still become a marker (or, for a start-only family, everything once it cannot)."""
    if not fmt.anywhere:
        rest = text.lstrip()
        opens = [*fmt.markers, "{"] if fmt.bare_json else list(fmt.markers)
        return 0 if any(m.startswith(rest) for m in opens) else len(text)
    return len(text) - max(partial_marker_length(text, m) for m in fmt.markers)


def partial_marker_length(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker`` (text a
    stream holds back: the next piece may complete the marker)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class _Incomplete(Exception):
    """The text ends before the next expected piece."""


class _Mismatch(Exception):
    """The text is not in the format."""


def _expect(text: str, pos: int, token: str) -> int:
    """``pos`` after optional whitespace and ``token`` (stripped; empty: whitespace only)."""
    pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
    token = token.strip()
    if text.startswith(token, pos):
        return pos + len(token)
    if token.startswith(text[pos:]):
        raise _Incomplete()
    raise _Mismatch()


def _scan_calls(fmt: ToolCallFormat, text: str, pos: int, final: bool) -> list[ScannedCall]:
    calls: list[ScannedCall] = []
    try:
        pos = _expect(text, pos, fmt.list_open)
        while True:
            if calls:
                after = _WS.match(text, pos).end()  # type: ignore[union-attr]
                if fmt.list_close and text.startswith(fmt.list_close, after):
                    return calls
                pos = _expect(text, pos, fmt.separator)
            pos = _expect(text, pos, fmt.call_open)
            pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
            head = _CALL_HEAD.match(text, pos)
            if head is None:
                raise _Incomplete() if not final and len(text) - pos < 512 else _Mismatch()
            try:
                name = json.loads(f'"{head.group(1)}"')
            except ValueError:
                raise _Mismatch() from None
            pos = head.end()
            try:
                _, end = _DECODER.raw_decode(text, pos)
            except ValueError:
                calls.append(ScannedCall(name, text[pos:], complete=False))
                return calls
            calls.append(ScannedCall(name, text[pos:end], complete=True))
            pos = _expect(text, end, "}")
            pos = _expect(text, pos, fmt.call_close)
    except (_Incomplete, _Mismatch):
        return calls
