"""The drafter of ``--speculative-algorithm EAGLE3``: an EAGLE-3 head
(``models/llama_eagle3.py``) run as :class:`EagleWorker` runs an EAGLE head (the same chain,
KV bookkeeping and per-row feature store), with two differences:

- the features are the target's hidden states after three of its decoder layers (residual
  stream, before the final norm), concatenated in layer order into (T, 3 * hidden): forward
  hooks on those layers record them while a step captures (``capture_hidden_states``), and the
  runner's sink stores them instead of the last hidden state. The layers are the head's
  ``config.json`` ``eagle_config.eagle_aux_hidden_state_layer_ids`` or, without it, SGLang's
  default ``[1, L // 2 - 1, L - 4]`` for a target of ``L`` layers (SGLang's
  ``set_eagle3_layers_to_capture``: the inputs of layers 2, L // 2 and L - 3);
- the head's argmax is over its draft vocabulary and mapped to target ids through ``d2t``.

:func:`build_eagle3_worker` checks the head against the target and refuses a mismatch with an
error naming the ``config.json`` field or tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch

from shardline_runtime.model_executor.forward_batch_info import ForwardBatch
from shardline_runtime.model_executor.model_runner import ModelRunner
from shardline_runtime.models.llama_eagle3 import AUX_LAYERS, LlamaForCausalLMEagle3
from shardline_runtime.speculative.draft_worker import DraftModelError
from shardline_runtime.speculative.eagle_worker import EagleWorker

AUX_FIELD = "eagle_config.eagle_aux_hidden_state_layer_ids"


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """SGLang's default aux layers of a target of ``num_layers`` decoder layers."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def aux_layer_ids(hf_config: dict[str, Any], num_layers: int, path: str) -> list[int]:
    """The target layers whose outputs feed the head (``config.json`` ``hf_config``).

    Raises:
        DraftModelError: not ``AUX_LAYERS`` integers, or one outside ``[0, num_layers - 1]``
            (naming the field, and the default's source when it was not set).
    """
    eagle_config = hf_config.get("eagle_config") or {}
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    source = f"config.json {AUX_FIELD}"
    if ids is None:
        ids = default_aux_layer_ids(num_layers)
        source = f"the default [1, L // 2 - 1, L - 4] for L = {num_layers} (set {AUX_FIELD})"
    if (
        not isinstance(ids, list)
        or len(ids) != AUX_LAYERS
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise DraftModelError(
            f"--speculative-draft-model-path {path}: {source} must be a list of {AUX_LAYERS} "
            f"layer ids, got {ids!r}"
        )
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise DraftModelError(
            f"--speculative-draft-model-path {path}: {source} is {ids}; layer id {bad[0]} is out "
            f"of range: the target has {num_layers} layers (ids 0..{num_layers - 1})"
        )
    return sorted(ids)


def check_eagle3_head(head_runner: ModelRunner, target: ModelRunner, path: str) -> list[int]:
    """Refuse a head that cannot read ``target``'s states; returns its aux layer ids.

    Raises:
        DraftModelError: ``hidden_size`` / ``target_hidden_size`` differs from the target's,
            ``d2t`` maps outside the target vocabulary, or the aux layer ids are bad.
    """
    config, target_config = head_runner.model_config, target.model_config
    h = target_config.hidden_size
    for field in ("hidden_size", "target_hidden_size"):
        value = config.hf_config.get(field, config.hidden_size)
        if value != h:
            raise DraftModelError(
                f"--speculative-draft-model-path {path}: config.json {field} {value} differs "
                f"from the target's hidden_size {h}; an EAGLE-3 head reads its states"
            )
    head = cast(LlamaForCausalLMEagle3, head_runner.model)
    ids = torch.arange(head.draft_vocab_size, device=head.d2t.device)
    mapped = head.draft_to_target(ids)
    outside = (mapped < 0) | (mapped >= target_config.vocab_size)
    if bool(outside.any()):
        first = int(outside.nonzero()[0, 0])
        raise DraftModelError(
            f"--speculative-draft-model-path {path}: d2t maps draft id {first} to target id "
            f"{int(mapped[first])}, outside the target vocabulary [0, {target_config.vocab_size})"
        )
    return aux_layer_ids(config.hf_config, target_config.num_hidden_layers, path)


class Eagle3Worker(EagleWorker):
    """An EAGLE-3 head's runner, its draft KV and the target's aux states (module docstring).

    Args:
        runner: the head's runner (its model a ``LlamaForCausalLMEagle3``).
        target: the target's runner; hooks go on its decoder layers ``layer_ids``.
        layer_ids: the aux layers, ascending (:func:`aux_layer_ids`).
    """

    def __init__(self, runner: ModelRunner, target: ModelRunner, layer_ids: list[int]):
        super().__init__(runner, target)
        self.layer_ids = layer_ids
        self.num_target_layers = target.model_config.num_hidden_layers
        self.feature_size = len(layer_ids) * target.model_config.hidden_size
        self._aux: dict[int, torch.Tensor] = {}
        layers = target.model.model.layers
        self._hooks = [
            layers[i].register_forward_hook(self._recorder(i)) for i in sorted(set(layer_ids))
        ]
        target.hidden_states_sink = self._capture
        target.hidden_states_need_eager = True  # the hooks run only in eager forwards

    def update_refusal(self, path: str) -> str:
        """A new head must read the layers this worker hooked (its ``config.json``'s aux layer
        ids, or their default, equal to :attr:`layer_ids`); "" when they match or its
        ``config.json`` cannot be read here (the loader then names the problem)."""
        try:
            hf_config = json.loads((Path(path) / "config.json").read_text())
            ids = aux_layer_ids(hf_config, self.num_target_layers, path)
        except (OSError, ValueError) as e:
            return str(e) if isinstance(e, DraftModelError) else ""
        if ids != self.layer_ids:
            return (
                f"{AUX_FIELD} selects target layers {ids}, but this server captures {self.layer_ids} "
                "(chosen at start); restart to change them"
            )
        return ""

    def _recorder(self, layer_id: int):
        def record(module, inputs, output) -> None:
            forward_batch = inputs[2]
            if getattr(forward_batch, "capture_hidden_states", False):
                hidden, residual = output
                self._aux[layer_id] = hidden if residual is None else hidden + residual

        return record

    def _capture(self, forward_batch: ForwardBatch, hidden_states: torch.Tensor) -> None:
        """The runner's sink: store this step's aux states (T, 3 * hidden) per request."""
        aux, self._aux = self._aux, {}
        self.features.capture(forward_batch, torch.cat([aux[i] for i in self.layer_ids], dim=-1))


def build_eagle3_worker(runner: ModelRunner, target: ModelRunner, path: str) -> Eagle3Worker:
    """Check the head (:func:`check_eagle3_head`) and hook it to ``target``."""
    return Eagle3Worker(runner, target, check_eagle3_head(runner, target, path))
