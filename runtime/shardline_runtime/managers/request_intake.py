"""New generation requests become ``Req`` objects in the waiting queue (or are answered at once).

The HTTP process validates first; this is the scheduler's defensive second look, against what
only the scheduler knows: the KV pool's limits and which LoRA adapters are loaded right now.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from shardline_runtime.constrained.grammar_spec import GrammarSpec
from shardline_runtime.constrained.xgrammar_backend import RequestGrammar
from shardline_runtime.managers.grammar_queue import GrammarQueue
from shardline_runtime.managers.io_struct import TokenizedGenerateReqInput
from shardline_runtime.managers.lora_control import LoRAControl
from shardline_runtime.managers.req import Req
from shardline_runtime.managers.scheduler_output import OutputSender


def eos_token_ids(model_config: Any) -> list[int]:
    """EOS ids from ``config.json`` and ``generation_config.json`` (int or list in either)."""
    ids: list[int] = []
    sources = [getattr(model_config, "hf_config", {}) or {}]
    gen_path = os.path.join(getattr(model_config, "model_path", ""), "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path, encoding="utf-8") as f:
            sources.append(json.load(f))
    for cfg in sources:
        value = cfg.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids


class RequestIntake:
    """Turns ``TokenizedGenerateReqInput`` into queued requests.

    Args:
        max_req_input_len: the longest prompt the KV pool takes (tokens).
        max_req_len: the longest prompt + output (tokens); ``max_new_tokens`` is clipped to fit.
        eos_token_ids: the model's EOS ids (:func:`eos_token_ids`).
        lora: the :class:`LoRAControl`, or None when LoRA is off.
        sender: rank 0's :class:`OutputSender` (answers requests that can never run).
        admit: puts a new request in the waiting queue (``PrefillManager.add``).
        grammars: makes a request's grammar matcher from its :class:`GrammarSpec`
            (``GrammarBackend.matcher``, built at the first constrained request), called in the
            :class:`GrammarQueue`'s worker threads; None: a constrained request is answered with
            an abort naming why.
        is_generation: False for an embedding model, whose requests run one EXTEND (possibly
            chunked) and sample nothing (``max_new_tokens`` 0 whatever they asked).
    """

    def __init__(
        self,
        max_req_input_len: int,
        max_req_len: int,
        eos_token_ids: list[int],
        lora: LoRAControl | None,
        sender: OutputSender,
        admit: Callable[[Req], None],
        grammars: Callable[[GrammarSpec], RequestGrammar] | None = None,
        is_generation: bool = True,
    ):
        self.is_generation = is_generation
        self.max_req_input_len = max_req_input_len
        self.max_req_len = max_req_len
        self.eos_token_ids = eos_token_ids
        self.lora = lora
        self.sender = sender
        self.admit = admit
        self.grammar_queue = (
            GrammarQueue(grammars, self.admit_ready, sender) if grammars is not None else None
        )

    def handle(self, msg: TokenizedGenerateReqInput) -> None:
        """Queue ``msg`` as a ``Req`` (a constrained one first waits in the ``GrammarQueue``
        while its grammar compiles), or answer it with an ``abort`` naming why it cannot run."""
        n = len(msg.input_ids)
        params = msg.sampling_params
        if n == 0 or n > self.max_req_input_len:
            self.sender.reject(
                msg.rid,
                n,
                f"the prompt has {n} tokens; this server accepts 1 to {self.max_req_input_len}",
            )
            return
        if self._lora_missing(msg.rid, msg.lora_name, n):
            # unloaded (or evicted) between the HTTP check and now: never let it reach a forward
            return
        if msg.grammar is not None and self.grammar_queue is None:
            self.sender.reject(msg.rid, n, f"{msg.grammar.param}: constrained decoding is off")
            return
        # The KV pool (not the context) may clip max_new_tokens: the request ends with "length".
        room = self.max_req_len - n if self.is_generation else 0
        if params.max_new_tokens is None or params.max_new_tokens > room:
            params = replace(params, max_new_tokens=room)
        embeds = None
        if msg.input_embeds_positions is not None:
            embeds = torch.tensor(msg.input_embeds_values, dtype=torch.float32)
        req = Req(
            msg.rid,
            msg.input_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num,
            logprob_start_len=msg.logprob_start_len,
            lora_name=msg.lora_name,
            input_embeds_positions=msg.input_embeds_positions,
            input_embeds_values=embeds,
        )
        if msg.grammar is None:
            self.admit(req)
        elif self.grammar_queue is not None:
            self.grammar_queue.submit(req, msg.grammar)

    def admit_ready(self, req: Req) -> None:
        """Queue ``req``, whose grammar has compiled, unless its LoRA adapter was unloaded
        meanwhile (then it is answered with an abort naming the adapter)."""
        if not self._lora_missing(req.rid, req.lora_name, len(req.origin_input_ids)):
            self.admit(req)

    def _lora_missing(self, rid: str, lora_name: str | None, prompt_tokens: int) -> bool:
        """Answer ``rid`` with an abort and return True when its adapter is not loaded."""
        if lora_name is None or (self.lora is not None and self.lora.is_loaded(lora_name)):
            return False
        self.sender.reject(rid, prompt_tokens, f"LoRA adapter {lora_name!r} is not loaded")
        return True
