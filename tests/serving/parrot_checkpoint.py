"""A tiny checkpoint whose greedy output cycles through the tokens of a chosen text.

Every layer's output projections are zeroed, so the last hidden state is the (normalised)
embedding of the current token; embeddings of the cycle's tokens are distinct basis vectors
and the LM head maps each to the next token of the cycle. Greedy decoding then repeats the
text exactly, which makes multi-token characters (CJK, emoji) appear on demand (field case R6).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


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
    shutil.copytree(src, dst, dirs_exist_ok=True)
    files = sorted(dst.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"expected one safetensors file in {src}, found {len(files)}")
    weights = load_file(str(files[0]))
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    hidden = embed.shape[1]
    if len(ids) > hidden:
        raise ValueError(f"cycle of {len(ids)} tokens exceeds hidden size {hidden}")
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    weights["model.norm.weight"].fill_(1.0)
    head.zero_()
    for j, token in enumerate(ids):
        embed[token] = torch.zeros(hidden)
        embed[token, j] = 1.0
        head[ids[(j + 1) % len(ids)], j] = 20.0
    save_file(weights, str(files[0]), metadata={"format": "pt"})
    return ids
