"""ForwardMode and ForwardBatch: the tensors one model step runs on.

A ``ScheduleBatch`` (scheduler side, CPU) decides which requests run and allocates their request
rows and KV slots; it then builds a :class:`ForwardBatch`, which is what ``ModelRunner.forward``,
the models and the attention backend read. The batch is passed explicitly through every call
(never through a global), following SGLang's ``ForwardBatch``.

Token layout: tokens of all requests are packed one after another (no padding), request ``i``
contributing ``extend_seq_lens[i]`` tokens in EXTEND (and TARGET_VERIFY) mode and exactly one token
in DECODE mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum, auto
from typing import TYPE_CHECKING, Any

import torch

from shardline_runtime.device_copy import to_device

if TYPE_CHECKING:
    from shardline_runtime.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
    from shardline_runtime.model_executor.host_decode_inputs import HostDecodeInputs


class ForwardMode(IntEnum):
    """What kind of step a batch runs.

    EXTEND: prefill of new tokens (possibly after a cached prefix, possibly one chunk of a
    chunked prefill). DECODE: one new token per request. IDLE: no tokens on this rank (keeps
    the ranks' collectives in step). SPLIT_PREFILL: EXTEND over a range of layers only.
    TARGET_VERIFY (speculative decoding): each request runs its last token and its draft tokens
    after its cached sequence, laid out as an EXTEND (``extend_seq_lens = 1 + drafts``), and the
    logits of every one of those tokens are returned (``speculative/``).
    """

    EXTEND = auto()
    DECODE = auto()
    IDLE = auto()
    SPLIT_PREFILL = auto()
    TARGET_VERIFY = auto()

    def is_extend(self) -> bool:
        """True for EXTEND, SPLIT_PREFILL and TARGET_VERIFY: each writes several tokens per
        request after a cached prefix, with the EXTEND attention layout (as SGLang's
        ``is_extend``)."""
        return self in (ForwardMode.EXTEND, ForwardMode.SPLIT_PREFILL, ForwardMode.TARGET_VERIFY)

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_split_prefill(self) -> bool:
        return self == ForwardMode.SPLIT_PREFILL


class PPProxyTensors:
    """What one pipeline stage hands the next (SGLang's ``PPProxyTensors``): named tensors, by
    default ``hidden_states`` (T, hidden_size) and ``residual`` (T, hidden_size) in the model
    dtype, after the stage's last layer. Models return it from a stage that is not the last and
    take it on a stage that is not the first; ``TpModelWorker`` sends and receives it."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        return f"PPProxyTensors({ {k: tuple(v.shape) for k, v in self.tensors.items()} })"


def _as_int64(name: str, value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.int64 and value.device == device:
            return value  # already there (a decode step's packed indices): no call, no copy
        if value.dtype not in (torch.int32, torch.int64):
            raise TypeError(
                f"ForwardBatch.{name} must be an integer tensor, got dtype {value.dtype}"
            )
        return to_device(value, device, torch.int64)
    return to_device(list(value), device, torch.int64)


@dataclass
class ForwardBatch:
    """All inputs of one model step.

    Shapes (``bs`` = batch size, ``T`` = tokens this step: ``sum(extend_seq_lens)`` in EXTEND,
    ``bs`` in DECODE, 0 in IDLE); every index tensor is int64 on the model's device:

    - ``input_ids`` (T,), ``positions`` (T,): token ids and their absolute positions.
    - ``req_pool_indices`` (bs,): rows of ``req_to_token_pool.req_to_token``.
    - ``seq_lens`` (bs,): total length of each request after this step (cached + new).
    - ``out_cache_loc`` (T,): KV-pool slots the new tokens' K/V are written to.
    - ``extend_seq_lens`` / ``extend_prefix_lens`` (bs,): new tokens / cached prefix length
      (``cached_len``) per request, EXTEND only; ``*_cpu`` are the same as Python lists.
    - ``extend_logprob_start_lens_cpu``: per request, the offset inside this step's new tokens
      from which prompt logprobs are returned (only read when ``return_logprob``).
    - ``top_logprobs_nums``: per request, how many top logprobs (prompt and sampled) per
      position (0 = none).
    - ``wants_token``: per request, whether sampling draws a token for it (``None``: every row).
    - ``return_logprobs``: per request, whether the sampled token's logprob is returned.
    - ``split_forward_start_layer`` / ``split_forward_end_layer``: layer range [start, end) of a
      SPLIT_PREFILL step.
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens: torch.Tensor | None = None
    extend_seq_lens_cpu: list[int] | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    req_to_token_pool: ReqToTokenPool | None = None
    token_to_kv_pool: TokenToKVPool | None = None
    attn_backend: Any = None
    return_logprob: bool = False
    top_logprobs_nums: list[int] | None = None
    extend_logprob_start_lens_cpu: list[int] | None = None
    sampling_info: Any = None
    wants_token: list[bool] | None = None
    return_logprobs: list[bool] | None = None
    split_forward_start_layer: int | None = None
    split_forward_end_layer: int | None = None
    # Hidden states carried between SPLIT_PREFILL calls: (T, hidden_size) and the residual.
    split_hidden_states: torch.Tensor | None = None
    split_residual: torch.Tensor | None = None
    # LoRA adapter name per request (None: the base model); None when no request uses one.
    lora_names: list[str | None] | None = None
    # Caller-given embeddings: packed token rows (K,) int64 and their vectors (K, hidden_size).
    input_embeds_indices: torch.Tensor | None = None
    input_embeds_values: torch.Tensor | None = None
    # Constrained decoding: (bs, ceil(vocab / 32)) int32 allowed-token bits per row, or None.
    grammar_bitmask: torch.Tensor | None = None
    # EAGLE: return the (T, hidden_size) states the logits come from (LogitsProcessorOutput);
    # the draft head's input features, (T, hidden_size) in the model dtype (models/llama_eagle).
    capture_hidden_states: bool = False
    spec_hidden_states: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Number of tokens run this step (``input_ids.shape[0]``)."""
        return int(self.input_ids.shape[0])

    @classmethod
    def host_decode(
        cls,
        inputs: HostDecodeInputs,
        model_runner: Any,
        input_ids: torch.Tensor,
        req_pool_indices: list[int],
        seq_lens: list[int],
        out_cache_loc: torch.Tensor,
        **fields: Any,
    ) -> ForwardBatch:
        """A DECODE step on the CPU, as :meth:`init_new` builds it, with the per-request index
        tensors written into ``inputs``' preallocated buffers (no torch call; the hot path of a
        CPU decode loop, see ``host_decode_inputs.py``). ``fields``: the optional fields, as
        ``init_new`` takes them (``return_logprob``, ``sampling_info``, ...).

        Raises:
            ValueError: the lengths disagree, or an id tensor is not int64.
        """
        bs = len(req_pool_indices)
        _check_host_decode(input_ids, out_cache_loc, bs)
        rows, lens, positions = inputs.rows(req_pool_indices, seq_lens)
        return cls(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=input_ids,
            positions=positions,
            req_pool_indices=rows,
            seq_lens=lens,
            out_cache_loc=out_cache_loc,
            seq_lens_cpu=list(seq_lens),
            req_to_token_pool=model_runner.req_to_token_pool,
            token_to_kv_pool=model_runner.token_to_kv_pool,
            attn_backend=model_runner.attn_backend,
            **fields,
        )

    def advance_host_decode(
        self,
        inputs: HostDecodeInputs,
        input_ids: torch.Tensor,
        req_pool_indices: list[int],
        seq_lens: list[int],
        out_cache_loc: torch.Tensor,
    ) -> None:
        """This :meth:`host_decode` batch, updated in place to the next DECODE step of the same
        requests (``managers/decode_record.py``): the same checks, the index tensors written
        into ``inputs``' next ring slot; the optional fields stay as they are.

        Raises:
            ValueError: the lengths disagree, or an id tensor is not int64.
        """
        _check_host_decode(input_ids, out_cache_loc, len(req_pool_indices))
        self.req_pool_indices, self.seq_lens, self.positions = inputs.rows(
            req_pool_indices, seq_lens
        )
        self.input_ids, self.out_cache_loc = input_ids, out_cache_loc
        self.batch_size = len(req_pool_indices)
        self.seq_lens_cpu = list(seq_lens)

    @classmethod
    def init_new(
        cls,
        *,
        forward_mode: ForwardMode,
        input_ids: torch.Tensor | Sequence[int],
        req_pool_indices: torch.Tensor | Sequence[int],
        seq_lens: torch.Tensor | Sequence[int],
        out_cache_loc: torch.Tensor | Sequence[int],
        model_runner: Any = None,
        extend_prefix_lens: torch.Tensor | Sequence[int] | None = None,
        positions: torch.Tensor | Sequence[int] | None = None,
        return_logprob: bool = False,
        top_logprobs_nums: list[int] | None = None,
        extend_logprob_start_lens: list[int] | None = None,
        sampling_info: Any = None,
        wants_token: list[bool] | None = None,
        return_logprobs: list[bool] | None = None,
        split_forward_start_layer: int | None = None,
        split_forward_end_layer: int | None = None,
        device: torch.device | str | None = None,
    ) -> ForwardBatch:
        """Build a ForwardBatch from plain tensors or lists and fill the derived fields.

        Derived: ``batch_size``; ``extend_seq_lens = seq_lens - extend_prefix_lens`` (EXTEND,
        ``extend_prefix_lens`` defaults to zeros); ``positions`` (default: ``prefix..seq_len-1``
        per request in EXTEND, ``seq_len - 1`` in DECODE); the ``*_cpu`` lists. Pools and the
        attention backend come from ``model_runner`` (attributes ``req_to_token_pool``,
        ``token_to_kv_pool``, ``attn_backend``, ``device``) when given.

        Raises:
            ValueError: lengths disagree (the message names the fields and their sizes).
            TypeError: an index tensor is not an integer tensor.
        """
        if device is None:
            device = getattr(model_runner, "device", "cpu")
        device = torch.device(device)
        # host copies from the host inputs (reading them back from the device would wait for it)
        seq_lens_cpu = (
            seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else [int(n) for n in seq_lens]
        )
        prefix_cpu = None
        if extend_prefix_lens is not None:
            prefix_cpu = (
                extend_prefix_lens.tolist()
                if isinstance(extend_prefix_lens, torch.Tensor)
                else [int(n) for n in extend_prefix_lens]
            )
        input_ids = _as_int64("input_ids", input_ids, device)
        if (
            forward_mode.is_decode()
            and positions is None
            and not isinstance(req_pool_indices, torch.Tensor)
        ):
            # a decode step's per-request indices go to the device as one (3, bs) tensor: one
            # host tensor and one copy per step in place of three (the host cost of batch 1)
            rows = list(req_pool_indices)
            if len(rows) != len(seq_lens_cpu):
                raise ValueError(
                    f"seq_lens has {len(seq_lens_cpu)} entries but req_pool_indices has {len(rows)}"
                )
            packed = to_device(
                [rows, seq_lens_cpu, [n - 1 for n in seq_lens_cpu]], device, torch.int64
            )
            req_pool_indices, seq_lens, positions = packed.unbind(0)
        req_pool_indices = _as_int64("req_pool_indices", req_pool_indices, device)
        seq_lens = _as_int64("seq_lens", seq_lens, device)
        out_cache_loc = _as_int64("out_cache_loc", out_cache_loc, device)
        bs = int(req_pool_indices.shape[0])
        if seq_lens.shape[0] != bs:
            raise ValueError(
                f"seq_lens has {seq_lens.shape[0]} entries but req_pool_indices has {bs}"
            )
        if out_cache_loc.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"out_cache_loc has {out_cache_loc.shape[0]} slots but input_ids has {input_ids.shape[0]} tokens"
            )
        extend_seq_lens = extend_seq_lens_cpu = extend_prefix_lens_cpu = None
        if forward_mode.is_extend():
            if extend_prefix_lens is None:
                extend_prefix_lens, prefix_cpu = [0] * bs, [0] * bs
            extend_prefix_lens = _as_int64("extend_prefix_lens", extend_prefix_lens, device)
            if extend_prefix_lens.shape[0] != bs:
                raise ValueError(
                    f"extend_prefix_lens has {extend_prefix_lens.shape[0]} entries, batch size is {bs}"
                )
            extend_seq_lens = seq_lens - extend_prefix_lens
            assert prefix_cpu is not None  # from the given lengths, or the zeros above
            extend_prefix_lens_cpu = prefix_cpu
            extend_seq_lens_cpu = [s - p for s, p in zip(seq_lens_cpu, prefix_cpu)]
            if any(n <= 0 for n in extend_seq_lens_cpu):
                raise ValueError(
                    f"every request must extend by >= 1 token; extend_seq_lens = {extend_seq_lens_cpu}"
                )
            if sum(extend_seq_lens_cpu) != input_ids.shape[0]:
                raise ValueError(
                    f"sum(seq_lens - extend_prefix_lens) = {sum(extend_seq_lens_cpu)} but input_ids has "
                    f"{input_ids.shape[0]} tokens"
                )
            if positions is None:
                positions = (
                    torch.cat(
                        [
                            torch.arange(p, s, dtype=torch.int64)
                            for p, s in zip(extend_prefix_lens_cpu, seq_lens_cpu)
                        ]
                    )
                    if bs
                    else torch.zeros(0, dtype=torch.int64)
                )
        elif forward_mode.is_decode():
            extend_prefix_lens = None
            if input_ids.shape[0] != bs:
                raise ValueError(
                    f"DECODE runs one token per request: input_ids has {input_ids.shape[0]}, batch size {bs}"
                )
            if positions is None:
                positions = seq_lens - 1
        else:
            extend_prefix_lens = None
            if positions is None:
                positions = torch.zeros(0, dtype=torch.int64)
        positions = _as_int64("positions", positions, device)
        if positions.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"positions has {positions.shape[0]} entries but input_ids has {input_ids.shape[0]}"
            )
        if forward_mode.is_split_prefill() and (
            split_forward_start_layer is None or split_forward_end_layer is None
        ):
            raise ValueError(
                "SPLIT_PREFILL needs split_forward_start_layer and split_forward_end_layer"
            )
        return cls(
            forward_mode=forward_mode,
            batch_size=bs,
            input_ids=input_ids,
            positions=positions,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            out_cache_loc=out_cache_loc,
            extend_seq_lens=extend_seq_lens,
            extend_prefix_lens=extend_prefix_lens,
            extend_seq_lens_cpu=extend_seq_lens_cpu,
            extend_prefix_lens_cpu=extend_prefix_lens_cpu,
            seq_lens_cpu=seq_lens_cpu,
            req_to_token_pool=getattr(model_runner, "req_to_token_pool", None),
            token_to_kv_pool=getattr(model_runner, "token_to_kv_pool", None),
            attn_backend=getattr(model_runner, "attn_backend", None),
            return_logprob=return_logprob,
            top_logprobs_nums=top_logprobs_nums,
            extend_logprob_start_lens_cpu=extend_logprob_start_lens,
            sampling_info=sampling_info,
            wants_token=wants_token,
            return_logprobs=return_logprobs,
            split_forward_start_layer=split_forward_start_layer,
            split_forward_end_layer=split_forward_end_layer,
        )


def _check_host_decode(input_ids: torch.Tensor, out_cache_loc: torch.Tensor, bs: int) -> None:
    if input_ids.dtype is not torch.int64 or out_cache_loc.dtype is not torch.int64:
        raise ValueError("host_decode takes int64 input_ids and out_cache_loc")
    if input_ids.shape[0] != bs or out_cache_loc.shape[0] != bs:
        raise ValueError(
            f"DECODE runs one token per request: input_ids has {input_ids.shape[0]}, "
            f"out_cache_loc {out_cache_loc.shape[0]}, batch size {bs}"
        )
