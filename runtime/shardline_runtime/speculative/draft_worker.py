"""The draft model of ``--speculative-algorithm STANDALONE``: a small causal LM of the target's
tokenizer, run by its own ``ModelRunner`` with its own KV pools (request rows, KV slots,
allocator), proposing a chain of greedy drafts.

Per request the worker keeps the tokens whose draft KV is written (``DraftCache``). A step:

1. the cached tokens are cut to their longest common prefix with the request's tokens now
   (prompt + output), and the draft KV past it freed (``keep``, called right after each verify
   step, does the same: the drafts the target rejected lose their slots in the draft pool as
   they do in the target's, the accepted ones keep theirs);
2. one EXTEND forward over every request's uncached tokens (the whole prompt the first time;
   afterwards the target's bonus token, plus the last draft when every draft was kept) gives
   the first draft, the argmax after the last token;
3. ``k - 1`` DECODE forwards, each over the previous draft, give the others.

The draft is deterministic (argmax), so the acceptance rule reads each draft as a point mass
and the output stays the target's, sampled or greedy (SGLang's STANDALONE worker with
``--speculative-eagle-topk 1`` does the same). A request the draft pool has no room for gets
no draft that step. At tp_size > 1 the draft is TP-sharded like the target and TP rank 0's
drafts are broadcast, so every rank verifies the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from shardline_runtime import distributed
from shardline_runtime.layers.logits_processor import LogitsProcessorOutput
from shardline_runtime.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from shardline_runtime.model_executor.model_runner import ModelRunner
from shardline_runtime.speculative.proposer import Proposal

EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle"  # config.json architectures[0] of an EAGLE head
# config.json architectures[0] each head algorithm needs
HEAD_ARCHITECTURES = {"EAGLE": EAGLE_ARCHITECTURE, "EAGLE3": "LlamaForCausalLMEagle3"}


class DraftModelError(ValueError):
    """The draft checkpoint cannot serve this target (names the flag and the mismatch)."""


def draft_server_args(args, max_total_tokens: int):
    """The draft runner's ``ServerArgs``: the target's, with the draft checkpoint, a KV pool of
    ``max_total_tokens`` tokens, no LoRA and no speculation of its own; built without graphs
    (:func:`build_draft_graphs` captures its decode graphs once the worker is wired)."""
    return args.replace(
        model_path=args.speculative_draft_model_path,
        model_source=None,
        served_model_name=None,
        tokenizer_path=None,
        revision=None,
        quantization="auto",
        kv_cache_dtype="auto",
        max_total_tokens=max_total_tokens,
        disable_cuda_graph=True,
        enable_piecewise_cuda_graph=False,
        enable_lora=False,
        lora_paths=(),
        speculative_algorithm=None,
        speculative_draft_model_path=None,
        speculative_num_steps=None,
        speculative_num_draft_tokens=None,
        enable_memory_saver=False,
    )


def check_draft_vocab(target_vocab: int, draft_vocab: int, path: str) -> None:
    """Refuse a draft whose vocabulary differs from the target's.

    Raises:
        DraftModelError: the sizes differ.
    """
    if draft_vocab != target_vocab:
        raise DraftModelError(
            f"--speculative-draft-model-path {path}: vocab_size {draft_vocab} differs from the "
            f"target's {target_vocab}; the draft must use the target's tokenizer"
        )


def build_draft_worker(
    args, tp_rank: int, pp_rank: int, target: ModelRunner, max_total_num_tokens: int
) -> DraftWorker | None:
    """The draft's worker: a :class:`DraftWorker` with STANDALONE, an ``EagleWorker`` with EAGLE
    (fed ``target``'s hidden states, sharing its embedding and LM head), an ``Eagle3Worker``
    with EAGLE3 (``speculative/eagle3_worker.py``), else None; its own
    runner on :func:`draft_server_args`, a KV pool of the target's ``max_total_num_tokens``.

    Raises:
        DraftModelError: the draft's vocabulary or hidden size is not the target's, or its
            architecture does not fit the algorithm (EAGLE3: also ``d2t`` and the aux layers).
    """
    spec = getattr(args, "speculative", None)
    if spec is None or spec.speculative_algorithm not in ("STANDALONE", "EAGLE", "EAGLE3"):
        return None
    algo = spec.speculative_algorithm
    path = str(spec.speculative_draft_model_path)
    runner = ModelRunner(draft_server_args(args, max_total_num_tokens), tp_rank, pp_rank)
    config, target_config = runner.model_config, target.model_config
    check_draft_architecture(algo, config.architecture, path)
    check_draft_vocab(target_config.vocab_size, runner.model_config.vocab_size, path)
    if algo == "STANDALONE":
        return build_draft_graphs(DraftWorker(runner), args.graphs)
    if algo == "EAGLE3":
        from shardline_runtime.speculative.eagle3_worker import build_eagle3_worker

        return build_draft_graphs(build_eagle3_worker(runner, target, path), args.graphs)
    if config.hidden_size != target_config.hidden_size:
        raise DraftModelError(
            f"--speculative-draft-model-path {path}: hidden_size {config.hidden_size} differs "
            f"from the target's {target_config.hidden_size}; an EAGLE head reads its states"
        )
    from shardline_runtime.speculative.eagle_worker import EagleWorker

    return build_draft_graphs(EagleWorker(runner, target), args.graphs)


def build_draft_graphs(worker: DraftWorker, settings) -> DraftWorker:
    """Give the draft runner decode graphs as the target's ``settings`` ask (``GraphArgs``;
    never piecewise or compiled): STANDALONE decode steps and EAGLE chain steps (their input
    features and predicted ones in static buffers) replay them. Built after the worker, since an
    EAGLE head can run only once it shares the target's embedding and LM head."""
    from shardline_runtime.model_executor.device_graphs import DeviceGraphs

    draft = replace(settings, enable_piecewise_cuda_graph=False, enable_torch_compile=False)
    worker.runner.graphs = DeviceGraphs.build(worker.runner, draft)
    return worker


def check_draft_architecture(algo: str, architecture: str, path: str) -> None:
    """EAGLE / EAGLE3 need their head's checkpoint (:data:`HEAD_ARCHITECTURES`), STANDALONE a
    causal LM.

    Raises:
        DraftModelError: naming the flag, the checkpoint's architecture and the expected one.
    """
    expected = HEAD_ARCHITECTURES.get(algo)
    if expected is not None and architecture != expected:
        raise DraftModelError(
            f"--speculative-draft-model-path {path}: config.json architectures[0] is "
            f"{architecture!r}; --speculative-algorithm {algo} needs {expected!r}"
        )
    heads = {arch: name for name, arch in HEAD_ARCHITECTURES.items()}
    if algo == "STANDALONE" and architecture in heads:
        raise DraftModelError(
            f"--speculative-draft-model-path {path} is an EAGLE head ({architecture}); use "
            f"--speculative-algorithm {heads[architecture]}"
        )


def draft_update(
    draft: DraftWorker | None, draft_model_path: str | None
) -> tuple[tuple[ModelRunner, str] | None, str]:
    """What a disk update with ``draft_model_path`` updates beside the target: ``((runner,
    path), "")``, ``(None, "")`` without a draft path, or ``(None, reason)`` when the server
    runs no draft model (the update is refused; nothing is loaded)."""
    if draft_model_path is None:
        return None, ""
    if draft is None:
        return None, (
            f"draft_model_path {draft_model_path} given but this server runs no draft model "
            "(--speculative-algorithm STANDALONE, EAGLE or EAGLE3); old weights kept"
        )
    refused = draft.update_refusal(draft_model_path)
    if refused:
        return None, f"draft_model_path {draft_model_path}: {refused}; old weights kept"
    return (draft.runner, draft_model_path), ""


@dataclass
class _Entry:
    row: int
    tokens: list[int] = field(default_factory=list)  # draft KV written at positions 0..len-1


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class DraftWorker:
    """A draft ``ModelRunner`` and the per-request draft KV it holds.

    Args:
        runner: the draft's own runner (its pools are the draft pools).

    Attributes:
        entries: request id -> its draft row and the tokens whose draft KV is written.
    """

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.entries: dict[str, _Entry] = {}

    @property
    def used_tokens(self) -> int:
        """Draft KV slots held (0 once every request is released)."""
        alloc = self.runner.token_to_kv_pool_allocator
        return alloc.size - alloc.available_size()

    def update_refusal(self, path: str) -> str:
        """Why a weight update cannot load the draft checkpoint ``path`` into this worker
        beyond what the loader checks ("" when nothing; EAGLE3 compares its aux layers)."""
        return ""

    def release(self, rid: str, row: int | None = None) -> None:
        """Free ``rid``'s draft row and KV slots (no-op for an unknown id; ``row``, its target
        row, is not needed here)."""
        entry = self.entries.pop(rid, None)
        if entry is None:
            return
        self._truncate(entry, 0)
        self.runner.req_to_token_pool.free(entry.row)

    def release_all(self) -> None:
        """Free every request's draft KV (after the draft's weights changed)."""
        for rid in list(self.entries):
            self.release(rid)

    def keep(self, rid: str, tokens: Sequence[int]) -> None:
        """Free ``rid``'s draft KV past its common prefix with ``tokens`` (the drafts the
        target rejected); the accepted drafts' KV stays."""
        entry = self.entries.get(rid)
        if entry is not None:
            self._truncate(entry, common_prefix(entry.tokens, tokens))

    def _truncate(self, entry: _Entry, keep: int) -> None:
        if keep < len(entry.tokens):
            pool = self.runner.req_to_token_pool
            self.runner.token_to_kv_pool_allocator.free(
                pool.slots(entry.row, keep, len(entry.tokens))
            )
            del entry.tokens[keep:]

    def _admit(
        self, rid: str, tokens: Sequence[int], prefix: int | None = None
    ) -> tuple[_Entry, int, torch.Tensor] | None:
        """Cut ``rid``'s cache to ``prefix`` (default: its common prefix with ``tokens``; the
        last token is always run) and allocate slots for the rest; None when the draft pools
        are full."""
        entry = self.entries.get(rid)
        if entry is None:
            rows = self.runner.req_to_token_pool.alloc(1)
            if rows is None:
                return None
            entry = self.entries[rid] = _Entry(rows[0])
        if prefix is None:
            prefix = min(common_prefix(entry.tokens, tokens), len(tokens) - 1)
        self._truncate(entry, prefix)
        slots = self.runner.token_to_kv_pool_allocator.alloc(len(tokens) - prefix)
        if slots is None:
            self.release(rid)
            return None
        return entry, prefix, slots

    def propose(
        self,
        rids: Sequence[str],
        histories: Sequence[Sequence[int]],
        max_drafts: Sequence[int],
        rows: Sequence[int] = (),
    ) -> Proposal:
        """Up to ``max_drafts[i]`` greedy drafts after ``histories[i]`` (module docstring;
        ``rows``, the target's request rows, are not needed here).

        Returns:
            a :class:`Proposal` without draft probabilities (point masses).
        """
        drafts: list[list[int]] = [[] for _ in rids]
        active = []
        ids: list[int] = []
        prefixes, lens, slot_parts = [], [], []
        room = self.runner.model_config.context_len
        for i, (rid, tokens, k) in enumerate(zip(rids, histories, max_drafts)):
            if k <= 0 or not tokens or len(tokens) + k > room:
                continue
            admitted = self._admit(rid, tokens)
            if admitted is None:
                continue
            entry, prefix, slots = admitted
            self.runner.req_to_token_pool.write((entry.row, slice(prefix, len(tokens))), slots)
            entry.tokens.extend(tokens[prefix:])
            ids += tokens[prefix:]
            active.append(i)
            prefixes.append(prefix)
            lens.append(len(tokens))
            slot_parts.append(slots)
        if active:
            rows = [self.entries[rids[i]].row for i in active]
            next_ids = self._run(
                ForwardMode.EXTEND, ids, rows, lens, torch.cat(slot_parts), prefixes
            )
            for i, t in zip(active, next_ids):
                drafts[i].append(t)
            self._decode_steps(rids, drafts, max_drafts, active)
        if self.runner.tp_size > 1:
            drafts = distributed.broadcast_pyobj(drafts)
        return Proposal(drafts)

    def _decode_steps(
        self,
        rids: Sequence[str],
        drafts: list[list[int]],
        max_drafts: Sequence[int],
        active: list[int],
    ) -> None:
        """DECODE steps over each request's last draft until it has ``max_drafts[i]``."""
        while True:
            step = [i for i in active if len(drafts[i]) < max_drafts[i]]
            rows, lens, slots = self._append_slots(rids, step, drafts)
            if slots is None:
                return
            next_ids = self._run(
                ForwardMode.DECODE, [drafts[i][-1] for i in step], rows, lens, slots, None
            )
            for i, t in zip(step, next_ids):
                drafts[i].append(t)

    def _append_slots(
        self, rids: Sequence[str], step: list[int], drafts: list[list[int]]
    ) -> tuple[list[int], list[int], torch.Tensor | None]:
        """One KV slot after each request ``i in step`` for its last draft: its draft rows, new
        lengths and the slots (None: no request, or the draft pool is full)."""
        slots = self.runner.token_to_kv_pool_allocator.alloc(len(step)) if step else None
        rows: list[int] = []
        lens: list[int] = []
        if slots is None:
            return rows, lens, None
        for i, slot in zip(step, slots.tolist()):
            entry = self.entries[rids[i]]
            self.runner.req_to_token_pool.write((entry.row, len(entry.tokens)), torch.tensor(slot))
            entry.tokens.append(drafts[i][-1])
            rows.append(entry.row)
            lens.append(len(entry.tokens))
        return rows, lens, slots

    def _run(
        self,
        mode: ForwardMode,
        input_ids: list[int],
        rows: list[int],
        seq_lens: list[int],
        out_cache_loc: torch.Tensor,
        prefixes: list[int] | None,
    ) -> list[int]:
        """One draft forward; the argmax after each request's last token."""
        output, _ = self._forward(mode, input_ids, rows, seq_lens, out_cache_loc, prefixes)
        return output.next_token_logits.argmax(dim=-1).tolist()

    def _forward(
        self,
        mode: ForwardMode,
        input_ids: list[int],
        rows: list[int],
        seq_lens: list[int],
        out_cache_loc: torch.Tensor,
        prefixes: list[int] | None,
        features: torch.Tensor | None = None,
    ) -> tuple[LogitsProcessorOutput, ForwardBatch]:
        """One draft forward (``features`` (T, hidden): an EAGLE head's input, whose predicted
        features then come back in ``hidden_states``)."""
        runner = self.runner
        forward_batch = ForwardBatch.init_new(
            forward_mode=mode,
            input_ids=input_ids,
            req_pool_indices=rows,
            seq_lens=seq_lens,
            out_cache_loc=out_cache_loc,
            extend_prefix_lens=prefixes,
            model_runner=runner,
        )
        forward_batch.spec_hidden_states = features
        forward_batch.capture_hidden_states = features is not None
        output = runner.forward(forward_batch)
        assert isinstance(output, LogitsProcessorOutput)  # a whole model, one stage
        return output, forward_batch
