"""A tiny checkpoint whose greedy output cycles through the tokens of a chosen text.

Every layer's output projections are zeroed, so the last hidden state is the (normalised)
embedding of the current token; embeddings of the cycle's tokens are distinct basis vectors
and the LM head maps each to the next token of the cycle
(``shardline_runtime.tiny_checkpoint.make_cycle_checkpoint``). Greedy decoding then repeats the
text exactly, which makes multi-token characters (CJK, emoji) appear on demand (field case R6).
"""

from __future__ import annotations

import json
from pathlib import Path

from shardline_runtime.tiny_checkpoint import make_cycle_checkpoint


def make_parrot_checkpoint(src: Path, dst: Path, tokenizer, text: str) -> list[int]:
    """Copy ``src`` to ``dst`` with weights that make greedy output repeat ``text``.

    Returns:
        The token ids of one cycle (distinct ids; the text must tokenize without repeats).

    Raises:
        ValueError: ``text`` has a repeated token id or more tokens than the hidden size.
    """
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(set(ids)) != len(ids):
        raise ValueError(f"text {text!r} repeats a token id: {ids}")
    hidden = json.loads((Path(src) / "config.json").read_text())["hidden_size"]
    # a head weight of 20 on the normalised basis vector (which the RMSNorm scales by sqrt(hidden))
    make_cycle_checkpoint(src, dst, ids, 20.0 * hidden**0.5)
    return ids
