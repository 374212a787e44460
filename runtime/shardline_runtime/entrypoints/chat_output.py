"""One chat choice's reply -> the OpenAI message (``content``, ``reasoning_content``,
``tool_calls``) or its stream deltas.

The reply text is split by the reasoning parser first (``reasoning_parser.py``), then its content
by the tool-call format (``tool_parsers.py``). Both split functions are re-run on the whole text
so far and only grow, so a stream sends their differences, and the deltas of a stream join into
exactly the non-streamed message. Stream deltas follow OpenAI's shape: a call's first delta has
its ``index``, ``id``, ``type`` and ``function.name`` with empty ``arguments``, later ones
``index`` and ``function.arguments`` fragments.
"""

from __future__ import annotations

import argparse
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardline_runtime.entrypoints.reasoning_parser import REASONING_PARSERS, split_reasoning
from shardline_runtime.entrypoints.tool_parsers import (
    ARCHITECTURE_FORMATS,
    TOOL_CALL_FORMATS,
    TOOL_CALL_PARSERS,
    ToolCallFormat,
    scan_reply,
)


@dataclass(frozen=True)
class ChatParsers:
    """The server's parsers (``--tool-call-parser`` resolved, ``--reasoning-parser``)."""

    tool_format: ToolCallFormat | None = None
    reasoning: str | None = None

    @classmethod
    def resolve(
        cls, tool_call_parser: str, reasoning_parser: str | None, model_path: str
    ) -> ChatParsers:
        """``tool_call_parser`` ``auto`` takes the family of ``config.json``'s first
        architecture under ``model_path`` (:data:`ARCHITECTURE_FORMATS`; none when unknown or
        unreadable: tool requests are then a 400 saying to set the flag).

        Raises:
            ValueError: an unknown parser name.
        """
        if tool_call_parser == "auto":
            try:
                config = json.loads((Path(model_path) / "config.json").read_text())
                architecture = (config.get("architectures") or [""])[0]
            except (OSError, ValueError, AttributeError, IndexError):
                architecture = ""
            family = ARCHITECTURE_FORMATS.get(architecture)
            fmt = TOOL_CALL_FORMATS[family] if family else None
        elif tool_call_parser in TOOL_CALL_FORMATS:
            fmt = TOOL_CALL_FORMATS[tool_call_parser]
        else:
            raise ValueError(
                f"--tool-call-parser must be one of {list(TOOL_CALL_PARSERS)}, "
                f"got {tool_call_parser!r}"
            )
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser must be one of {list(REASONING_PARSERS)}, "
                f"got {reasoning_parser!r}"
            )
        return cls(fmt, reasoning_parser)


def add_chat_parser_flags(group: argparse._ArgumentGroup, tool_call_default: str) -> None:
    """``--tool-call-parser`` and ``--reasoning-parser`` on the server's argument ``group``."""
    group.add_argument(
        "--tool-call-parser",
        default=tool_call_default,
        choices=TOOL_CALL_PARSERS,
        help="How chat replies write tool calls: llama3 (JSON), hermes / qwen (<tool_call>), "
        "mistral ([TOOL_CALLS]); auto: from config.json's architecture.",
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="Split <think>...</think> out of chat replies into reasoning_content: qwen3 (a "
        "reply that opens <think>) or deepseek-r1 (the reply starts inside thinking). Default: "
        "none.",
    )


def new_call_id() -> str:
    """A tool call id in OpenAI's form (``call_`` + 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatOutput:
    """The parsed view of one choice's reply.

    Args:
        reasoning: the reasoning parser's name (None: no split).
        tool_format: the family whose calls to read (None: the reply is content).
    """

    def __init__(self, reasoning: str | None, tool_format: ToolCallFormat | None):
        self.reasoning = reasoning
        self.tool_format = tool_format
        self.text = ""
        self._sent_reasoning = 0
        self._sent_content = 0
        self._sent_calls: list[tuple[str, int]] = []  # (id, argument characters sent)

    @property
    def passthrough(self) -> bool:
        return self.reasoning is None and self.tool_format is None

    def _parts(self, final: bool) -> tuple[str | None, str, list[Any]]:
        reasoning, content = None, self.text
        if self.reasoning is not None:
            split = split_reasoning(self.reasoning, self.text, final)
            reasoning, content = split.reasoning, split.content
        if self.tool_format is None:
            return reasoning, content, []
        scanned = scan_reply(self.tool_format, content, final)
        return reasoning, scanned.content, scanned.calls

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The final message of the whole reply ``text``, and whether it has tool calls."""
        self.text = text
        reasoning, content, calls = self._parts(final=True)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["content"] = content or None
            message["tool_calls"] = [
                {
                    "id": self._sent_calls[i][0] if i < len(self._sent_calls) else new_call_id(),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for i, call in enumerate(calls)
            ]
        return message, bool(calls)

    def delta(self, piece: str, final: bool) -> dict[str, Any]:
        """The stream delta of ``piece`` (the reply's next text; ``final``: nothing follows):
        ``content`` / ``reasoning_content`` / ``tool_calls``, each only when it has news."""
        self.text += piece
        if self.passthrough:
            return {"content": piece} if piece else {}
        reasoning, content, calls = self._parts(final)
        out: dict[str, Any] = {}
        if reasoning is not None and len(reasoning) > self._sent_reasoning:
            out["reasoning_content"] = reasoning[self._sent_reasoning :]
            self._sent_reasoning = len(reasoning)
        if len(content) > self._sent_content:
            out["content"] = content[self._sent_content :]
            self._sent_content = len(content)
        tool_deltas = self._call_deltas(calls)
        if tool_deltas:
            out["tool_calls"] = tool_deltas
        return out

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._sent_calls)

    def _call_deltas(self, calls: list[Any]) -> list[dict[str, Any]]:
        """One entry per call with news: a new call's id, type, name and arguments so far; an
        older call's next arguments fragment."""
        deltas = []
        for i, call in enumerate(calls):
            entry: dict[str, Any] = {"index": i}
            if i == len(self._sent_calls):
                self._sent_calls.append((new_call_id(), 0))
                entry.update(id=self._sent_calls[i][0], type="function")
                entry["function"] = {"name": call.name, "arguments": ""}
            call_id, sent = self._sent_calls[i]
            if len(call.arguments) > sent:
                entry.setdefault("function", {})["arguments"] = call.arguments[sent:]
                self._sent_calls[i] = (call_id, len(call.arguments))
            if "function" in entry:
                deltas.append(entry)
        return deltas
