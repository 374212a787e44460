"""A running batch's decode record: its last DECODE step's ``ModelWorkerBatch`` and overlap
snapshot, advanced in place while its rows stay the same (host work, issue 24).

In steady decode the same requests run step after step; only the per-step values move on: each
request's input id, its new KV slot (``out_cache_loc``) and its length. Building a fresh
``ModelWorkerBatch`` (with its per-request flags: logprobs, adapters, grammars), a fresh
``ForwardBatch`` from it and a fresh snapshot of the rows for the overlap loop costs about twenty
Python calls a step, most of them from cold caches after the model's forward. A
:class:`DecodeRecord` keeps them and writes only what moved.

The record belongs to the ``reqs`` list it was made for. A ``ScheduleBatch`` never changes that
list in place: filtering, merging and mixing give the batch a new list, so a record whose list is
not the batch's list any more is stale and a new one is made (``ScheduleBatch.get_model_worker_batch``).
Per-request flags that do not change over a request's life (``return_logprob``, ``lora_name``, a
grammar, ``top_logprobs_num``) are kept; ``wants_token`` and the grammar bitmask are computed
again each step.

Why in place is safe: the worker reads a ``ModelWorkerBatch`` while it runs the step and keeps
nothing of it; ``launch_step`` replaces its ``input_ids`` by the resolved ids. The ``ForwardBatch``
the runner built from it is kept by the step's ``GenerationBatchResult``, and processing a DECODE
step's result reads nothing of it (only an EXTEND step's prompt logprobs do), and the overlap
snapshot is read, never written, by the processing of each step it stands for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shardline_runtime.managers.model_worker_batch import ModelWorkerBatch

if TYPE_CHECKING:
    from shardline_runtime.managers.schedule_batch import ScheduleBatch


class DecodeRecord:
    """The reusable parts of one running batch's DECODE steps.

    Args:
        reqs: the ``ScheduleBatch.reqs`` list (the object) the record stands for.
        batch: the ``ModelWorkerBatch`` built for the first of these steps.

    Attributes:
        snapshot: the overlap loop's read-only copy of the rows (``ScheduleBatch.snapshot``),
            made on first use.
    """

    def __init__(self, reqs: list[Any], batch: ModelWorkerBatch):
        self.reqs = reqs
        self.batch = batch
        self.snapshot: ScheduleBatch | None = None

    def advance(self, schedule_batch: ScheduleBatch, futures: bool) -> ModelWorkerBatch:
        """The record's ``ModelWorkerBatch`` updated to ``schedule_batch``'s prepared DECODE
        step (the same rows, in the same order).

        Args:
            futures: every input id is a future placeholder (overlap scheduling).
        """
        batch = self.batch
        sb = schedule_batch
        batch.input_ids = (
            sb.future_ids() if futures else torch.as_tensor(sb.input_ids, dtype=torch.int64)
        )
        batch.seq_lens = list(sb.seq_lens)
        batch.out_cache_loc = sb.out_cache_loc
        batch.wants_token = [r.wants_token for r in sb.reqs]
        batch.sampling_info = sb.sampling_info
        batch.future_rows = batch.req_pool_indices if futures else None
        if batch.grammar_bitmask is not None:
            batch.grammar_bitmask = sb.grammar_bitmask()
        return batch
