"""Token bitmasks applied to logits: the sampler's side of constrained decoding.

A bitmask row holds ``ceil(vocab / 32)`` int32 words; bit ``t % 32`` of word ``t // 32`` set means
token ``t`` may be sampled (xgrammar's layout, filled per request by
``constrained/xgrammar_backend.py``). Plain torch, so the same code runs on CPU and GPU and the
sampler never imports the grammar library.
"""

from __future__ import annotations

import torch

_SHIFTS_CACHE: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS_CACHE.get(device)
    if shifts is None:
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        _SHIFTS_CACHE[device] = shifts
    return shifts


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of disallowed tokens to ``-inf``, in place.

    Args:
        logits: (bs, V) float logits (V may be below ``32 * width``: the tail bits are unused).
        bitmask: (bs, width) int32 with ``width >= ceil(V / 32)``, on any device (moved to
            the logits' device).

    Returns:
        ``logits``.

    Raises:
        ValueError: the row counts differ or the mask is too narrow for V.
    """
    bs, vocab = logits.shape
    if bitmask.shape[0] != bs or bitmask.shape[1] * 32 < vocab:
        raise ValueError(
            f"bitmask of shape {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}"
        )
    mask = bitmask.to(logits.device, non_blocking=True)
    # (bs, width, 32) bits -> (bs, width * 32) allowed flags, cut to the vocabulary
    allowed = ((mask.unsqueeze(-1) >> _shifts(logits.device)) & 1).bool().flatten(1)[:, :vocab]
    return logits.masked_fill_(~allowed, float("-inf"))
