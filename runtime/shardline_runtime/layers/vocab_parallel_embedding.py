"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded up to a multiple of ``tp_size`` and split into equal contiguous
ranges, one per rank; padded rows are zero. ``LogitsProcessor`` drops the padded columns of the
gathered logits, so a padded id can never be sampled or returned in logprobs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardline_runtime.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from shardline_runtime.layers.linear import _check_shape
from shardline_runtime.layers.parameter import set_weight_attrs


def pad_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Smallest multiple of ``tp_size`` >= ``vocab_size``."""
    return -(-vocab_size // tp_size) * tp_size


class VocabParallelEmbedding(nn.Module):
    """Embedding table whose rows (token ids) are split over TP ranks.

    Args:
        num_embeddings: real vocabulary size (checkpoint rows).
        embedding_dim: hidden size.

    Attributes:
        weight: (padded_vocab / tp, embedding_dim); rank r owns ids
            ``[vocab_start_index, vocab_end_index)``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ):
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tensor_model_parallel_world_size() if tp_size is None else tp_size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False
        )
        set_weight_attrs(self.weight, self.weight_loader, {None: (num_embeddings, embedding_dim)})

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy rows ``[vocab_start_index, min(vocab_end_index, num_embeddings))``; zero the padding."""
        _check_shape(loaded, (self.num_embeddings, self.embedding_dim), type(self).__name__)
        end = min(self.vocab_end_index, self.num_embeddings)
        n = max(end - self.vocab_start_index, 0)
        param.data.zero_()
        if n:
            param.data[:n].copy_(loaded[self.vocab_start_index : end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) int64 -> (T, embedding_dim); all-reduces the per-rank partial lookups."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = torch.where(
            mine, input_ids - self.vocab_start_index, torch.zeros_like(input_ids)
        )
        out = F.embedding(local_ids, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection with the embedding's row split; used by ``LogitsProcessor``
    (``logits_shard = hidden @ weight^T``, then all-gather over ranks)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor, not called directly")
