"""The drafter of ``--speculative-algorithm EAGLE``: an EAGLE head (``models/llama_eagle.py``)
run by its own ``ModelRunner`` and KV pools, fed the target's hidden states.

Features. The target runner calls :meth:`FeatureStore.capture` after every step that reaches
its logits (prefill chunks, DECODE, TARGET_VERIFY) with the (T, hidden) states the logits came
from; they are kept per target request row and absolute position (a later step at the same
position overwrites an earlier one, so a rejected draft's state is replaced by the accepted
token's before it is read). A request whose prefix came from the radix cache has no captured
state there: zeros stand in (only its acceptance suffers; verification keeps the output exact).

A step for a request of ``L`` tokens ``x[0..L-1]`` (draft position ``p`` holds token ``x[p+1]``
and the target's feature ``f[p]``; the target has run ``x[0..L-2]``):

1. draft KV written with the head's own predicted features (last step's chain) is dropped, and
   one EXTEND forward runs draft positions ``n..L-2`` (those not yet run with the target's
   features: the whole prompt the first time, afterwards the tokens the last verify step kept);
   its argmax after ``x[L-1]`` is the first draft;
2. ``k - 1`` DECODE forwards each run the previous draft with the head's predicted feature
   ``f_hat`` of the position before (EAGLE's chain: Li et al. 2024, SGLang's ``eagle_worker``
   with ``--speculative-eagle-topk 1``).

Drafts are argmax (point masses for the acceptance rule, so sampled output keeps the target's
distribution). At tp_size > 1 TP rank 0's drafts are broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from shardline_runtime import distributed
from shardline_runtime.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from shardline_runtime.model_executor.model_runner import ModelRunner
from shardline_runtime.models.llama_eagle import LlamaForCausalLMEagle
from shardline_runtime.speculative.draft_worker import DraftWorker, common_prefix
from shardline_runtime.speculative.proposer import Proposal


class FeatureStore:
    """The target's hidden states per request row: row -> list of (first position, (n, hidden))
    chunks, in capture order."""

    def __init__(self) -> None:
        self.chunks: dict[int, list[tuple[int, torch.Tensor]]] = {}

    def capture(self, forward_batch: ForwardBatch, hidden_states: torch.Tensor) -> None:
        """Keep ``hidden_states`` (T, hidden) of one target step, split per request by
        ``forward_batch``'s layout (one token each in DECODE, ``extend_seq_lens_cpu`` else)."""
        rows = forward_batch.req_pool_indices.tolist()
        if forward_batch.forward_mode.is_decode():
            counts = [1] * len(rows)
        else:
            counts = list(forward_batch.extend_seq_lens_cpu or [])
        starts = forward_batch.positions.tolist()
        offset = 0
        for row, n in zip(rows, counts):
            if n:
                start = starts[offset]
                if start == 0:  # a new request's first chunk: nothing older is its own
                    self.chunks.pop(row, None)
                part = hidden_states[offset : offset + n].detach().clone()
                self.chunks.setdefault(row, []).append((start, part))
            offset += n

    def take(self, row: int, start: int, end: int, hidden: int, like: torch.Tensor) -> torch.Tensor:
        """Row ``row``'s features at positions ``[start, end)``, (end - start, ``hidden``) in
        ``like``'s dtype and device (zeros where none was captured); chunks wholly before
        ``end`` are dropped (later steps never read them)."""
        out = like.new_zeros(end - start, hidden)
        kept = []
        for first, part in self.chunks.get(row, []):
            lo, hi = max(first, start), min(first + part.shape[0], end)
            if lo < hi:
                out[lo - start : hi - start] = part[lo - first : hi - first].to(out.dtype)
            if first + part.shape[0] > end:
                kept.append((first, part))
        self.chunks[row] = kept
        return out

    def drop(self, row: int) -> None:
        self.chunks.pop(row, None)


class EagleWorker(DraftWorker):
    """The EAGLE head's runner, its per-request draft KV (:class:`DraftWorker`'s bookkeeping:
    ``entries[rid].tokens[p]`` is the token at draft position ``p``, ``x[p + 1]``), and the
    target's features.

    Args:
        runner: the head's own runner (its model a ``LlamaForCausalLMEagle``).
        target: the target's runner; its embedding and LM head are shared with the head and its
            ``hidden_states_sink`` is set to :meth:`FeatureStore.capture`.
    """

    def __init__(self, runner: ModelRunner, target: ModelRunner):
        super().__init__(runner)
        self.head = cast(LlamaForCausalLMEagle, runner.model)
        self.head.set_embed_and_head(target.model.get_input_embeddings(), target.model.lm_head)
        self.features = FeatureStore()
        # width of the target's features the head reads (EAGLE-3: three layers' states)
        self.feature_size = runner.model_config.hidden_size
        target.hidden_states_sink = self.features.capture
        self.target_rows: dict[str, int] = {}
        self.true_len: dict[str, int] = {}  # draft positions run with the target's features

    def release(self, rid: str, row: int | None = None) -> None:
        """Free ``rid``'s head KV and the target's features of its row ``row`` (also of a
        request released before its first draft step)."""
        known = self.target_rows.pop(rid, None)
        for r in (row, known):
            if r is not None:
                self.features.drop(r)
        self.true_len.pop(rid, None)
        super().release(rid)

    def keep(self, rid: str, tokens: Sequence[int]) -> None:
        """Drop ``rid``'s draft KV written from predicted features (all of the last chain)."""
        entry = self.entries.get(rid)
        if entry is not None:
            self._truncate(entry, min(self.true_len.get(rid, 0), len(entry.tokens)))

    def propose(
        self,
        rids: Sequence[str],
        histories: Sequence[Sequence[int]],
        max_drafts: Sequence[int],
        rows: Sequence[int] = (),
    ) -> Proposal:
        """Up to ``max_drafts[i]`` greedy drafts after ``histories[i]`` (module docstring);
        ``rows[i]`` is request ``i``'s target row (where its features were captured).

        Returns:
            a :class:`Proposal` without draft probabilities (point masses).
        """
        drafts: list[list[int]] = [[] for _ in rids]
        active: list[int] = []
        ids: list[int] = []
        prefixes, lens, slot_parts, feats = [], [], [], []
        room = self.runner.model_config.context_len
        like = self.head.fc_weight
        hidden = self.feature_size
        for i, (rid, tokens, k) in enumerate(zip(rids, histories, max_drafts)):
            if k <= 0 or len(tokens) < 2 or not rows or len(tokens) + k > room:
                continue
            admitted = self._admit_positions(rid, tokens[1:])
            if admitted is None:
                continue
            entry, prefix, slots = admitted
            end = len(tokens) - 1
            self.runner.req_to_token_pool.write((entry.row, slice(prefix, end)), slots)
            entry.tokens.extend(tokens[prefix + 1 :])
            self.target_rows[rid], self.true_len[rid] = rows[i], end
            feats.append(self.features.take(rows[i], prefix, end, hidden, like))
            ids += tokens[prefix + 1 :]
            active.append(i)
            prefixes.append(prefix)
            lens.append(end)
            slot_parts.append(slots)
        if active:
            r = [self.entries[rids[i]].row for i in active]
            next_ids, f_hat = self._run_head(
                ForwardMode.EXTEND, ids, r, lens, torch.cat(slot_parts), prefixes, feats
            )
            for i, t in zip(active, next_ids):
                drafts[i].append(t)
            self._chain(rids, drafts, max_drafts, dict(zip(active, f_hat)))
        if self.runner.tp_size > 1:
            drafts = distributed.broadcast_pyobj(drafts)
        return Proposal(drafts)

    def _admit_positions(self, rid: str, inputs: Sequence[int]):
        """Keep ``rid``'s draft KV run with the target's features that ``inputs`` (``x[1..]``)
        still agrees with, but at least the last position is run again; allocate the rest.
        None when the draft pools are full."""
        entry = self.entries.get(rid)
        true_len = self.true_len.get(rid, 0) if entry is not None else 0
        prefix = min(true_len, len(inputs) - 1)
        if entry is not None:
            prefix = min(prefix, common_prefix(entry.tokens, inputs))
        return self._admit(rid, inputs, prefix)

    def _chain(
        self,
        rids: Sequence[str],
        drafts: list[list[int]],
        max_drafts: Sequence[int],
        f_hat: dict[int, torch.Tensor],
    ) -> None:
        """DECODE steps over each request's last draft and the head's last predicted feature
        until it has ``max_drafts[i]`` drafts."""
        while True:
            step = [i for i in f_hat if len(drafts[i]) < max_drafts[i]]
            rows, lens, slots = self._append_slots(rids, step, drafts)
            if slots is None:
                return
            features = [f_hat[i][None] for i in step]
            next_ids, new_f = self._run_head(
                ForwardMode.DECODE, [drafts[i][-1] for i in step], rows, lens, slots, None, features
            )
            for i, t, f in zip(step, next_ids, new_f):
                drafts[i].append(t)
                f_hat[i] = f

    def _run_head(self, mode, input_ids, rows, seq_lens, out_cache_loc, prefixes, features):
        """One head forward with ``features`` (per request (n_i, feature width)); the argmax (as
        a target id) and the predicted feature (hidden,) after each request's last token."""
        output, fb = self._forward(
            mode, input_ids, rows, seq_lens, out_cache_loc, prefixes, torch.cat(features)
        )
        assert output.hidden_states is not None
        last = [1] * len(rows) if mode.is_decode() else fb.extend_seq_lens_cpu or []
        idx = torch.tensor(last, device=output.hidden_states.device).cumsum(0) - 1
        ids = self.head.draft_to_target(output.next_token_logits.argmax(dim=-1))
        return ids.tolist(), list(output.hidden_states[idx])
