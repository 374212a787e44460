"""One sampling step of a ModelRunner: the tokens (and logprobs) of the rows that want one."""

from __future__ import annotations

import torch

from shardline_runtime import distributed
from shardline_runtime.constrained.xgrammar_backend import apply_token_bitmask
from shardline_runtime.device_copy import to_device
from shardline_runtime.layers.logits_processor import LogitsProcessorOutput
from shardline_runtime.layers.sampler import Sampler, greedy_on_host
from shardline_runtime.model_executor.forward_batch_info import ForwardBatch
from shardline_runtime.model_executor.generation_result import GenerationBatchResult


def sample_batch(
    sampler: Sampler,
    logits_output: LogitsProcessorOutput,
    forward_batch: ForwardBatch,
    device: torch.device,
    tp_size: int,
) -> GenerationBatchResult:
    """Draw one token for each row that wants one; the only sampling path.

    Rows with ``forward_batch.wants_token[i] == False`` (intermediate chunks,
    ``max_new_tokens == 0``) get -1. Logprobs (raw, see ``layers/sampler.py``) for rows
    with ``return_logprobs[i]``, top logprobs for ``top_logprobs_nums[i] > 0``. Rows of a
    constrained request (``forward_batch.grammar_bitmask``) sample only the tokens their grammar
    allows; their logprobs are those of the masked distribution (disallowed tokens ``-inf``). Penalty
    counts of the sampled rows are updated. At tp_size > 1 the token ids and their logprobs
    are broadcast from TP rank 0 on the device group, so every rank holds the same result.

    Returns:
        :class:`GenerationBatchResult` with ``next_token_ids`` (bs,) int64 on the device.
    """
    bs = forward_batch.batch_size
    wants = forward_batch.wants_token
    every_row = wants is None or all(wants)
    info = forward_batch.sampling_info
    if (  # a greedy step of plain rows on the CPU (most decode steps): argmax only
        every_row
        and not forward_batch.return_logprob
        and forward_batch.grammar_bitmask is None
        and sampler.broadcast is None
        and info.all_greedy
        and info.penalties is None
    ):
        greedy = greedy_on_host(
            logits_output.next_token_logits, bs, info.vocab_size, sampler.host_ids
        )
        if greedy is not None:
            return GenerationBatchResult(
                logits_output,
                forward_batch,
                greedy[0],
                sampled_rows=list(range(bs)),
                logprob_rows=[False] * bs,
                top_logprobs_nums=[0] * bs,
                host_ids=greedy[1],
            )
    rows = list(range(bs)) if wants is None or every_row else [i for i, w in enumerate(wants) if w]
    result = GenerationBatchResult(
        logits_output=logits_output, forward_batch=forward_batch, sampled_rows=rows
    )
    if not rows:
        result.next_token_ids = torch.full((bs,), -1, dtype=torch.int64, device=device)
        return result
    logits = logits_output.next_token_logits
    row_index = None
    if not every_row:
        info = info.copy_rows(rows)
        row_index = to_device(rows, device, torch.int64)
        logits = logits[row_index]
    if forward_batch.grammar_bitmask is not None:
        # constrained rows: disallowed tokens to -inf before penalties, logprobs and the draw
        # (every TP rank fills the same mask from the same matchers; PP: the last stage samples)
        bitmask = forward_batch.grammar_bitmask
        if every_row:  # keep the runner's logits (a graph's output buffer) as they are
            logits = logits.clone()
        else:  # logits are already a copy of these rows
            bitmask = bitmask[rows]
        apply_token_bitmask(logits, bitmask)
    asked = forward_batch.return_logprobs or [False] * bs
    result.logprob_rows = [asked[i] for i in rows]
    nums = forward_batch.top_logprobs_nums or [0] * bs
    result.top_logprobs_nums = [nums[i] if asked[i] else 0 for i in rows]
    top_nums = result.top_logprobs_nums if any(result.top_logprobs_nums) else None
    # forward, not __call__: the sampler has no hooks, and __call__ is two more frames a step
    out = sampler.forward(logits, info, any(result.logprob_rows), top_nums)
    if out.next_token_logprobs is not None and tp_size > 1:
        distributed.broadcast_tensor(out.next_token_logprobs, src=0)
    if forward_batch.sampling_info.penalties is not None:
        forward_batch.sampling_info.penalties.cumulate_output_tokens(out.next_token_ids, row_index)
    if row_index is None:  # every row sampled: the ids are the result as they are
        result.next_token_ids = out.next_token_ids
    else:
        result.next_token_ids = torch.full((bs,), -1, dtype=torch.int64, device=device)
        result.next_token_ids[row_index] = out.next_token_ids
    result.sampled_logprobs = out.next_token_logprobs
    result.top_values, result.top_indices = out.top_logprobs_val, out.top_logprobs_idx
    return result
