"""The verify step of speculative decoding: the target's logits of a TARGET_VERIFY forward ->
the tokens each request keeps (``speculative/acceptance.py``), with their logprobs.

A TARGET_VERIFY batch lays request ``i`` out as ``1 + k_i`` tokens: its last accepted token,
then its ``k_i`` draft tokens (``input_ids``); the model returned the logits after every one of
them. At tp_size > 1 the kept tokens are broadcast from TP rank 0 (as sampled ids are), so every
rank appends the same tokens.
"""

from __future__ import annotations

import torch

from shardline_runtime import distributed
from shardline_runtime.layers.logits_processor import LogitsProcessorOutput
from shardline_runtime.layers.sampler import top_logprobs
from shardline_runtime.model_executor.forward_batch_info import ForwardBatch
from shardline_runtime.model_executor.generation_result import GenerationBatchResult
from shardline_runtime.speculative.acceptance import accept_greedy, accept_sampled, target_probs


def verify_batch(
    logits_output: LogitsProcessorOutput,
    forward_batch: ForwardBatch,
    device: torch.device,
    tp_size: int,
) -> GenerationBatchResult:
    """The kept tokens of every request of a TARGET_VERIFY step.

    Args:
        logits_output: ``next_token_logits`` (T, vocab) float32, after every token.
        forward_batch: the step (``extend_seq_lens_cpu[i] = 1 + k_i``; ``sampling_info``
            without penalties: the scheduler verifies only batches without them).

    Returns:
        a :class:`GenerationBatchResult` with ``accepted_ids`` (per request, 1 to ``k_i + 1``
        ids, on the host), ``next_token_ids`` (bs,) the last of them, and, for requests that
        asked, ``accepted_logprobs`` / ``accepted_top_logprobs`` (raw logprobs, as the sampler's).

    Raises:
        ValueError: a request has penalties (their counts would change inside the chain).
    """
    info = forward_batch.sampling_info
    if info.penalties is not None:
        raise ValueError("TARGET_VERIFY does not apply penalties; verify batches without them")
    lens = forward_batch.extend_seq_lens_cpu or []
    bs = len(lens)
    logits = logits_output.next_token_logits  # (T, vocab)
    token_ids = forward_batch.input_ids.tolist()
    argmax = logits.argmax(dim=-1).tolist()
    rows = torch.repeat_interleave(
        torch.arange(bs, device=logits.device), torch.tensor(lens, device=logits.device)
    )
    probs = None if info.all_greedy else target_probs(logits, info, rows)
    greedy = info.is_greedy.tolist()
    accepted: list[list[int]] = []
    offset = 0
    for i, n in enumerate(lens):
        drafts = token_ids[offset + 1 : offset + n]
        if greedy[i] or probs is None:
            accepted.append(accept_greedy(argmax[offset : offset + n], drafts))
        else:
            accepted.append(
                accept_sampled(probs[offset : offset + n], drafts, None, info.generators[i])
            )
        offset += n
    if tp_size > 1:
        accepted = _broadcast_accepted(accepted, max(lens, default=1), logits.device)
    result = GenerationBatchResult(logits_output=logits_output, forward_batch=forward_batch)
    result.next_token_ids = torch.tensor([a[-1] for a in accepted], dtype=torch.int64)
    result.accepted_ids = accepted
    if forward_batch.return_logprob:
        _accepted_logprobs(result, logits, lens)
    return result


def _broadcast_accepted(accepted: list[list[int]], width: int, device) -> list[list[int]]:
    """TP rank 0's kept tokens on every rank: a (bs, width) int64 tensor padded with -1."""
    packed = torch.full((len(accepted), width), -1, dtype=torch.int64, device=device)
    for i, ids in enumerate(accepted):
        packed[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    distributed.broadcast_tensor(packed, src=0)
    return [[t for t in row if t >= 0] for row in packed.tolist()]


def _accepted_logprobs(
    result: GenerationBatchResult, logits: torch.Tensor, lens: list[int]
) -> None:
    """Per asking request, the raw logprob (and top logprobs) of each kept token at the
    position that scored it."""
    fb = result.forward_batch
    asked = fb.return_logprobs or [False] * len(lens)
    nums = fb.top_logprobs_nums or [0] * len(lens)
    values: list[list[float]] = []
    tops: list[list[tuple[list[float], list[int]]]] = []
    offset = 0
    for i, n in enumerate(lens):
        ids = (result.accepted_ids or [])[i]
        if not asked[i]:
            values.append([])
            tops.append([])
            offset += n
            continue
        raw = torch.log_softmax(logits[offset : offset + len(ids)].float(), dim=-1)
        picked = torch.tensor(ids, dtype=torch.int64, device=raw.device)
        values.append(raw.gather(1, picked[:, None]).squeeze(1).tolist())
        if nums[i] > 0:
            v, idx = top_logprobs(raw, [nums[i]] * len(ids))
            tops.append(list(zip(v, idx)))
        else:
            tops.append([])
        offset += n
    result.accepted_logprobs, result.accepted_top_logprobs = values, tops
