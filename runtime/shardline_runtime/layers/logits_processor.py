"""LogitsProcessor: last-token logits of each request and, on request, prompt logprobs.

Logits are computed per rank on its vocabulary shard, all-gathered over TP ranks and cut to
the real ``vocab_size`` (columns of the padded vocabulary never leave this module, so padded
ids are never sampled nor returned in logprobs).

Prompt logprobs (``forward_batch.return_logprob`` in EXTEND): for request ``i`` with ``e``
new tokens this step and start offset ``s = extend_logprob_start_lens_cpu[i]`` (default 0),
position ``p`` in ``[s, e - 1)`` of the step gives the logprob of the step's token ``p + 1``.
The token after the step's last one is scored from ``next_token_logits`` by the caller (it is
the first token of the next chunk, or the sampled token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardline_runtime.distributed import tensor_model_parallel_all_gather
from shardline_runtime.layers.linear import linear

if TYPE_CHECKING:
    from shardline_runtime.layers.vocab_parallel_embedding import VocabParallelEmbedding


@dataclass
class LogitsProcessorOutput:
    """Output of one model step.

    Attributes:
        next_token_logits: (bs, vocab_size) float32, logits after the last token of each request;
            (T, vocab_size), after every token, in a TARGET_VERIFY step.
        input_token_logprobs: per request a (n_i,) float32 tensor (see module docstring), or None.
        input_top_logprobs_val / input_top_logprobs_idx: per request (n_i, k_i) float32 values and
            int64 token ids of the top ``top_logprobs_nums[i]`` logprobs at the same positions.
        hidden_states: (T, hidden_size), the states the logits were computed from, for every
            token of the step; only when ``forward_batch.capture_hidden_states`` (EAGLE's
            features), else None.
    """

    next_token_logits: torch.Tensor
    input_token_logprobs: list[torch.Tensor] | None = None
    input_top_logprobs_val: list[torch.Tensor] | None = None
    input_top_logprobs_idx: list[torch.Tensor] | None = None
    hidden_states: torch.Tensor | None = None


class LogitsProcessor(nn.Module):
    """Computes :class:`LogitsProcessorOutput` from final hidden states.

    Args:
        vocab_size: real (unpadded) vocabulary size.
    """

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def _logits(self, hidden: torch.Tensor, lm_head: VocabParallelEmbedding) -> torch.Tensor:
        shard = linear(
            hidden, lm_head.weight
        )  # (N, padded_vocab / tp), model dtype as transformers
        return tensor_model_parallel_all_gather(shard, dim=-1)[:, : self.vocab_size].float()

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        lm_head: VocabParallelEmbedding,
        forward_batch,
    ) -> LogitsProcessorOutput:
        """input_ids (T,), hidden_states (T, hidden) -> logits of each request's last token
        (TARGET_VERIFY: of every token, ``next_token_logits`` (T, vocab))."""
        mode = forward_batch.forward_mode
        captured = hidden_states if getattr(forward_batch, "capture_hidden_states", False) else None
        if mode.is_target_verify():
            logits = self._logits(hidden_states, lm_head)
            return LogitsProcessorOutput(next_token_logits=logits, hidden_states=captured)
        if mode.is_extend() and forward_batch.extend_seq_lens is not None:
            last = torch.cumsum(forward_batch.extend_seq_lens, dim=0) - 1
            last_hidden = hidden_states[last]
        else:
            last_hidden = hidden_states
        out = LogitsProcessorOutput(
            next_token_logits=self._logits(last_hidden, lm_head), hidden_states=captured
        )
        if mode.is_extend() and forward_batch.return_logprob:
            self._prompt_logprobs(out, input_ids, hidden_states, lm_head, forward_batch)
        return out

    def _prompt_logprobs(
        self, out: LogitsProcessorOutput, input_ids, hidden_states, lm_head, forward_batch
    ) -> None:
        lens = forward_batch.extend_seq_lens_cpu
        starts = forward_batch.extend_logprob_start_lens_cpu or [0] * len(lens)
        tops = forward_batch.top_logprobs_nums or [0] * len(lens)
        rows, targets, counts = [], [], []
        offset = 0
        for e, s in zip(lens, starts):
            s = min(max(s, 0), e)
            n = max(e - 1 - s, 0)
            rows.append(torch.arange(offset + s, offset + s + n, device=input_ids.device))
            targets.append(input_ids[offset + s + 1 : offset + s + 1 + n])
            counts.append(n)
            offset += e
        rows_t, targets_t = torch.cat(rows), torch.cat(targets)
        logprobs = torch.log_softmax(
            self._logits(hidden_states[rows_t], lm_head), dim=-1
        )  # (N, vocab)
        token_lp = (
            logprobs.gather(1, targets_t.unsqueeze(1)).squeeze(1)
            if rows_t.numel()
            else logprobs.new_zeros(0)
        )
        out.input_token_logprobs = list(torch.split(token_lp, counts))
        if any(k > 0 for k in tops):
            per_req = torch.split(logprobs, counts)
            vals, idxs = [], []
            for lp, k in zip(per_req, tops):
                k = min(max(k, 0), self.vocab_size)
                v, i = (
                    lp.topk(k, dim=-1)
                    if k
                    else (
                        lp.new_zeros(lp.shape[0], 0),
                        torch.zeros(lp.shape[0], 0, dtype=torch.int64, device=lp.device),
                    )
                )
                vals.append(v)
                idxs.append(i)
            out.input_top_logprobs_val, out.input_top_logprobs_idx = vals, idxs
