"""What a request constrains its output to, as the HTTP process sends it to the scheduler.

A :class:`GrammarSpec` is a plain record (no grammar-library object) so it travels in
``TokenizedGenerateReqInput`` and keys the compiled-grammar cache. The request fields that make
one (OpenAI ``response_format``, SGLang's and vLLM's ``regex`` / ``ebnf`` / ``json_schema``
extras) are read in ``entrypoints/``; this module only fixes the kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "structural_tag"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")


class GrammarError(ValueError):
    """The grammar library rejected a spec (bad schema, regex or EBNF); ``param`` names the
    request field it came from (HTTP 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """One output constraint.

    Attributes:
        kind: ``json_schema`` (``source`` is the schema as JSON text), ``json_object`` (any JSON
            object; ``source`` empty), ``regex`` (a regular expression the whole output matches)
            ``ebnf`` (a GBNF/EBNF grammar whose ``root`` rule is the output) or ``structural_tag``
            (xgrammar's structural-tag JSON: fixed text around JSON-schema contents, e.g. tool
            calls in a model family's format; built by ``entrypoints/tool_calls.py``).
        source: the schema / regex / grammar text.
        strict: for ``json_schema``: OpenAI's ``strict`` (true: no property or item beyond the
            schema's, as OpenAI's structured outputs; false: JSON Schema's own default, where an
            object without ``additionalProperties: false`` may carry more properties).
        param: the request field it came from (``response_format``, ``regex``, ``ebnf``,
            ``tool_choice``), named by the 400 when the library rejects it.
    """

    kind: GrammarKind
    source: str = ""
    strict: bool = True
    param: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"GrammarSpec.kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
