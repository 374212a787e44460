"""Req: one generation request as the scheduler tracks it (tokens, KV row, logprobs, finish)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardline_runtime.constrained.xgrammar_backend import RequestGrammar
from shardline_runtime.layers.pooler import PoolingAccumulator
from shardline_runtime.managers.io_struct import FinishReason
from shardline_runtime.mem_cache.radix_cache import TreeNode
from shardline_runtime.sampling.sampling_params import SamplingParams


class Req:
    """One generation request as the scheduler tracks it.

    Args:
        rid: request id.
        origin_input_ids: prompt token ids (non-empty).
        sampling_params: validated :class:`SamplingParams`.
        eos_token_ids: ids that end generation unless ``ignore_eos``.
        return_logprob: return logprobs of output tokens (and prompt tokens from
            ``logprob_start_len``).
        top_logprobs_num: top logprobs per position (0 for none).
        logprob_start_len: first prompt position whose logprob is returned; -1 for none.
        lora_name: the LoRA adapter this request runs with (None: the base model).
        input_embeds_positions / input_embeds_values: caller-given prompt embeddings, positions
            (P,) and vectors (P, hidden_size) float32; None for none.
        grammar: the request's grammar matcher (constrained decoding; None: free text). Each
            step's token bitmask row is filled from it and each accepted token advances it.

    Attributes:
        output_ids: generated ids so far.
        fill_ids: the tokens whose KV this round ends with (prompt + output, possibly cut to a
            chunk by the scheduler before ``prepare_for_extend``).
        prefix_indices: (cached_len,) int64 KV slots of an already computed prefix.
        req_pool_idx: row in ``req_to_token`` (``None`` until the first extend).
        kv_len: tokens whose K/V are written in the row.
        finished_reason: ``None`` while running.
        last_node / tree_prefix_len: the prefix-cache node this request locks and how many of
            its KV slots belong to the cache (set by ``CacheManager.lock``, cleared on release).
        cached_tokens: prompt tokens served from the prefix cache at first admission (reported).
        admitted: set at the first admission; a request retracted and admitted again keeps its
            ``cached_tokens`` (its own re-cached KV is not a cache hit for the user).
        sent_len: output tokens already streamed to the HTTP process.
        prompt_logprobs: (position, logprob, top) of scored prompt tokens, collected per chunk.
        input_logprobs_sent: the prompt logprobs went out (once, with the first output).
        pooling: (embedding models) the pooled partials of the chunks run so far.
        embedding: (embedding models) the finished embedding, set after the last chunk.
    """

    def __init__(
        self,
        rid: str,
        origin_input_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: Sequence[int] = (),
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        lora_name: str | None = None,
        input_embeds_positions: Sequence[int] | None = None,
        input_embeds_values: torch.Tensor | None = None,
        grammar: RequestGrammar | None = None,
        admitted_at: float | None = None,
    ):
        if len(origin_input_ids) == 0:
            raise ValueError(f"request {rid}: origin_input_ids must not be empty")
        self.rid = rid
        self.origin_input_ids = list(origin_input_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = set(eos_token_ids)
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        self.logprob_start_len = logprob_start_len
        self.lora_name = lora_name
        self.input_embeds_positions = (
            None if input_embeds_positions is None else list(input_embeds_positions)
        )
        self.input_embeds_values = input_embeds_values
        self.grammar = grammar
        self.admitted_at = admitted_at  # the HTTP process's clock (TokenizedGenerateReqInput)
        self.output_ids: list[int] = []
        self.fill_ids: list[int] = list(self.origin_input_ids)
        self.prefix_indices = torch.zeros(0, dtype=torch.int64)
        self.req_pool_idx: int | None = None
        self.kv_len = 0
        self.finished_reason: FinishReason | None = None
        self.input_token_logprobs: list[float] = []
        self.output_token_logprobs: list[float] = []
        self.output_top_logprobs: list[tuple[list[float], list[int]]] = []
        self.last_node: TreeNode | None = None
        self.tree_prefix_len = 0
        self.cached_tokens = 0
        self.admitted = False
        self.sent_len = 0
        self.prompt_logprobs: list[tuple[int, float, list[tuple[float, int]]]] = []
        self.input_logprobs_sent = False
        self.pooling: PoolingAccumulator | None = None
        self.embedding: list[float] | None = None
        self._generator: torch.Generator | None = None

    @property
    def cached_len(self) -> int:
        """Length of the prefix whose KV is reused this round: the tokens already in the
        request's row when it has one (later chunks, decode), else ``prefix_indices``."""
        if self.req_pool_idx is not None:
            return self.kv_len
        return int(self.prefix_indices.shape[0])

    @property
    def row(self) -> int:
        """``req_pool_idx`` of a request that holds a row.

        Raises:
            RuntimeError: the request holds no row (not yet prefilled, or released).
        """
        if self.req_pool_idx is None:
            raise RuntimeError(f"request {self.rid} holds no req_to_token row")
        return self.req_pool_idx

    @property
    def extend_input_len(self) -> int:
        return len(self.fill_ids) - self.cached_len

    @property
    def is_chunked(self) -> bool:
        """After ``prepare_for_extend``: True when this round's KV stops short of the whole
        sequence (an intermediate chunk of a chunked prefill; no token is sampled)."""
        return self.kv_len < len(self.origin_input_ids) + len(self.output_ids)

    @property
    def wants_token(self) -> bool:
        """After the step is prepared: True when its forward should sample a token for this
        request (the whole sequence is in the KV cache and ``max_new_tokens != 0``)."""
        return not self.is_chunked and self.sampling_params.max_new_tokens != 0

    def finished(self) -> bool:
        return self.finished_reason is not None

    def init_next_round_input(
        self, prefix_indices: torch.Tensor | None = None, max_extend_len: int | None = None
    ) -> None:
        """Set ``fill_ids`` / ``prefix_indices`` for the next EXTEND.

        Args:
            prefix_indices: KV slots of a reusable prefix (e.g. a prefix-cache match); when the
                request already holds a row, the tokens it computed earlier are reused instead.
            max_extend_len: cut the new tokens to this many (a chunked-prefill chunk).
        """
        full = self.origin_input_ids + self.output_ids
        if self.req_pool_idx is not None:
            pass  # a later chunk: the prefix is what this request's row already holds
        elif prefix_indices is not None:
            # at least one token must be computed to produce logits
            self.prefix_indices = prefix_indices[: len(full) - 1].to(torch.int64)  # host slots
        else:
            self.prefix_indices = torch.zeros(0, dtype=torch.int64)
        end = (
            len(full)
            if max_extend_len is None
            else min(len(full), self.cached_len + max_extend_len)
        )
        self.fill_ids = full[:end]

    def sampling_generator(self, device: torch.device | str) -> torch.Generator | None:
        """The request's own generator when seeded (created once, then advanced every step)."""
        seed = self.sampling_params.seed
        if seed is None:
            return None
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(seed)
        return self._generator

    def append_output(
        self, token_id: int, logprob: float | None = None, top: tuple | None = None
    ) -> None:
        """Record a sampled token (and its logprob / top logprobs when asked)."""
        self.output_ids.append(int(token_id))
        if logprob is not None:
            self.output_token_logprobs.append(float(logprob))
        if top is not None:
            self.output_top_logprobs.append(top)

    def advance_grammar(self, token_id: int) -> None:
        """Advance the grammar with an accepted token: a complete grammar (its stop token
        accepted) finishes the request with ``stop``; a token it refuses (a masked step never
        samples one) aborts it, naming the grammar."""
        if self.grammar is None or self.finished_reason is not None:
            return
        if not self.grammar.accept(token_id):
            self.finished_reason = FinishReason(
                "abort", message=f"token {token_id} does not fit the request's grammar"
            )
        elif self.grammar.is_terminated():
            self.finished_reason = FinishReason("stop", int(token_id))

    def check_finished(self, max_req_len: int) -> None:
        """Set ``finished_reason`` from the last token and the limits.

        Args:
            max_req_len: the worker's limit on prompt + output tokens.
        """
        if self.finished_reason is not None:
            return
        params = self.sampling_params
        if params.max_new_tokens is not None and len(self.output_ids) >= params.max_new_tokens:
            self.finished_reason = FinishReason("length", params.max_new_tokens)
            return
        if not self.output_ids:
            return
        last = self.output_ids[-1]
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            self.finished_reason = FinishReason("stop", last)
        elif len(self.origin_input_ids) + len(self.output_ids) >= max_req_len:
            self.finished_reason = FinishReason("length", max_req_len)
