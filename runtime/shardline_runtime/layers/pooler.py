"""Pooler: one vector per request from the final hidden states of an EXTEND step.

Pooling follows sentence-transformers' ``Pooling`` module (``pooling_mode_lasttoken``,
``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``) and its ``Normalize`` module (L2,
``torch.nn.functional.normalize``). A long input may be prefilled in chunks, so the model
returns a *partial* per request and step (the last token's state, the sum of the step's states,
or the step's first state) and the scheduler folds the partials of one request together in a
:class:`PoolingAccumulator`; the embedding is complete after the request's last chunk. The
prefix cache is off for embedding models, so every token of an input runs through the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardline_runtime.configs.pooling_config import PoolingType


@dataclass
class EmbeddingPoolerOutput:
    """Output of an embedding model's step.

    Attributes:
        pooled: (bs, hidden_size) float32, this step's partial of each request (see the module
            docstring): the last token's state (LAST), the sum over the step's tokens (MEAN), or
            the step's first token's state (CLS).
    """

    pooled: torch.Tensor


class Pooler(nn.Module):
    """This step's partial per request, from (T, hidden) states laid out request after request
    (``forward_batch.extend_seq_lens`` tokens each; a DECODE step has one token per request)."""

    def __init__(self, pooling_type: PoolingType):
        super().__init__()
        self.pooling_type = pooling_type

    def forward(self, hidden_states: torch.Tensor, forward_batch) -> EmbeddingPoolerOutput:
        lens = forward_batch.extend_seq_lens
        if not forward_batch.forward_mode.is_extend() or lens is None:
            return EmbeddingPoolerOutput(hidden_states.float())
        ends = torch.cumsum(lens, dim=0)  # (bs,)
        if self.pooling_type is PoolingType.LAST:
            pooled = hidden_states[ends - 1]
        elif self.pooling_type is PoolingType.CLS:
            pooled = hidden_states[ends - lens]
        else:  # MEAN: the step's sum; the accumulator divides by the input's length
            rows = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens)
            pooled = torch.zeros(
                lens.shape[0], hidden_states.shape[1], device=hidden_states.device
            ).index_add_(0, rows, hidden_states.float())
        return EmbeddingPoolerOutput(pooled.float())


class PoolingAccumulator:
    """One request's embedding, folded from the partials of its chunks (host tensors).

    Args:
        pooling_type: how partials combine: LAST keeps the latest, CLS the first, MEAN sums
            and divides by the tokens seen.
        normalize: L2-normalise the result (a sentence-transformers ``Normalize`` module).
    """

    def __init__(self, pooling_type: PoolingType, normalize: bool):
        self.pooling_type = pooling_type
        self.normalize = normalize
        self.vector: torch.Tensor | None = None
        self.tokens = 0

    def add(self, partial: torch.Tensor, tokens: int) -> None:
        """Fold in one step's (hidden_size,) float32 ``partial`` covering ``tokens`` tokens."""
        if self.vector is None or self.pooling_type is PoolingType.LAST:
            self.vector = partial.clone()
        elif self.pooling_type is PoolingType.MEAN:
            self.vector += partial
        self.tokens += tokens

    def embedding(self) -> list[float]:
        """The finished embedding, (hidden_size,) floats.

        Raises:
            RuntimeError: no step was added.
        """
        if self.vector is None:
            raise RuntimeError("no hidden states were pooled for this request")
        vector = self.vector / self.tokens if self.pooling_type is PoolingType.MEAN else self.vector
        if self.normalize:
            vector = nn.functional.normalize(vector, p=2, dim=0)
        return vector.tolist()
