"""Speculative decoding with an EAGLE-3 head (``--speculative-algorithm EAGLE3``) through the
scheduler on a real tiny target and tiny EAGLE-3 checkpoints written in the public format
(``fc`` over three aux states, ``midlayer``, ``norm``, a draft-vocabulary ``lm_head``, ``d2t`` /
``t2d``): the aux states the head reads are the target's layer outputs (against transformers'
``output_hidden_states``); greedy output equals greedy output without speculation token for
token (alone and in the mixed batch); a head that advances the cycle has every chain kept
(fc, the fed-back pre-norm state and d2t all take part); sampled output follows the target's
distribution; target and head update together; bad heads are refused naming the field, and
both heads (EAGLE's too) refuse features of another shape naming the field."""

from __future__ import annotations

import random
import re
from types import SimpleNamespace

import pytest
import torch
from scheduler_harness import greedy, make_scheduler
from speculative_harness import (
    CYCLE,
    check_greedy_mixed,
    check_greedy_single,
    check_sampled_distribution,
    prompt,
    run,
    spec_flags,
    update_replies,
)

from shardline_runtime.configs.model_config import ModelConfig
from shardline_runtime.models.llama_eagle import LlamaForCausalLMEagle
from shardline_runtime.models.llama_eagle3 import LlamaForCausalLMEagle3
from shardline_runtime.speculative.draft_worker import DraftModelError
from shardline_runtime.speculative.eagle_checkpoint import (
    make_cycle_eagle3_checkpoint,
    make_eagle3_checkpoint,
    make_eagle_checkpoint,
)

LAYERS = [0, 1, 1]  # the tiny target has 2 layers; SGLang's default needs at least 4


@pytest.fixture(scope="module")
def head(cycle_target, tmp_path_factory):
    """Advances the cycle; wrong after ``CYCLE[2]`` (some drafts are rejected)."""
    dst = tmp_path_factory.mktemp("head3")
    return make_cycle_eagle3_checkpoint(cycle_target, dst, CYCLE, LAYERS, wrong_after=2)


def _flags(head_path, tokens: int = 4) -> dict:
    return spec_flags("EAGLE3", head_path, tokens)


def test_greedy_single_request_equals_no_speculation(cycle_target, head):
    check_greedy_single(cycle_target, _flags(head), CYCLE * 3 + prompt(random.Random(1), 10), new_tokens=30)


def test_greedy_mixed_workload_equals_no_speculation(cycle_target, head):
    check_greedy_mixed(cycle_target, _flags(head))


def test_a_head_that_advances_the_cycle_has_its_chains_accepted(cycle_target, tmp_path):
    perfect = make_cycle_eagle3_checkpoint(cycle_target, tmp_path / "perfect", CYCLE, LAYERS)
    _, scheduler = run(cycle_target, {0: [greedy("one", CYCLE * 3, 40)]}, _flags(perfect, tokens=5))
    stats = scheduler.speculative.stats
    assert stats.accepted_tokens == stats.draft_tokens, "every draft of the chain was kept"
    assert stats.mean_accepted_length > 4.5


@pytest.mark.parametrize(("layer_ids", "expected"), [([2, 0, 1], [0, 1, 2]), (None, [0, 1, 1])])
def test_the_head_reads_the_outputs_of_the_targets_aux_layers(tiny_checkpoint, tmp_path, layer_ids, expected):
    """Ascending layer order, as SGLang concatenates; None: SGLang's default [1, L/2-1, L-4]."""
    from transformers import AutoModelForCausalLM

    deep = tiny_checkpoint("llama", 4, num_hidden_layers=4, max_position_embeddings=2048, tokenizer=False)
    head3 = make_eagle3_checkpoint(deep, tmp_path / "head", layer_ids=layer_ids)
    ids = prompt(random.Random(2), 17)
    scheduler = make_scheduler(deep, disable_overlap_schedule=True, **_flags(head3))
    scheduler.run_step([greedy("r", ids, 8)])
    row = scheduler.decode_manager.running_reqs[0].req_pool_idx
    worker = scheduler.worker.draft_worker
    assert worker.layer_ids == expected
    (start, captured), *_ = worker.features.chunks[row]
    hf = AutoModelForCausalLM.from_pretrained(deep, torch_dtype=torch.float32)
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    reference = torch.cat([states[i + 1][0] for i in expected], dim=-1)  # after layer i
    assert start == 0 and captured.shape == (len(ids), 3 * 64)
    torch.testing.assert_close(captured, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda t, d, w: make_eagle3_checkpoint(w, d, layer_ids=LAYERS), "config.json hidden_size 96 differs"),
        (lambda t, d, w: make_eagle3_checkpoint(t, d, layer_ids=LAYERS, drop=("d2t",)), "parameter d2t was never written"),
        (lambda t, d, w: make_eagle3_checkpoint(t, d, layer_ids=[0, 1, 2]), "layer id 2 is out of range"),
        (lambda t, d, w: make_eagle3_checkpoint(t, d, layer_ids=[0, 1]), "must be a list of 3 layer ids"),
        (lambda t, d, w: make_eagle3_checkpoint(t, d), "set eagle_config.* layer id -2 is out of range"),
        (lambda t, d, w: make_eagle_checkpoint(t, d), "EAGLE3 needs 'LlamaForCausalLMEagle3'"),
        (lambda t, d, w: _without_draft_vocab(make_eagle3_checkpoint(t, d, layer_ids=LAYERS)), "draft_vocab_size must be"),
    ],
    ids=["hidden_size", "no-d2t", "aux-out-of-range", "aux-count", "aux-default", "eagle-head", "no-draft-vocab"],
)
def test_a_mismatched_head_is_refused_naming_the_field(spec_target, tiny_checkpoint, tmp_path, make, message):
    wide = tiny_checkpoint("llama", 2, hidden_size=96, tokenizer=False)
    with pytest.raises(Exception, match=message):
        make_scheduler(spec_target, **_flags(make(spec_target, tmp_path / "bad", wide)))


def _without_draft_vocab(path):
    import json

    config = json.loads((path / "config.json").read_text())
    del config["draft_vocab_size"]
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_an_eagle3_head_is_refused_by_eagle_and_standalone(spec_target, tmp_path):
    head3 = make_eagle3_checkpoint(spec_target, tmp_path / "head", layer_ids=LAYERS)
    for algo, message in (("EAGLE", "EAGLE needs 'LlamaForCausalLMEagle'"), ("STANDALONE", "use --speculative-algorithm EAGLE3")):
        with pytest.raises(DraftModelError, match=message):
            make_scheduler(spec_target, **spec_flags(algo, head3))


@pytest.mark.parametrize("shape", [None, (3, 128), (2, 64), (3,)], ids=["none", "width", "tokens", "1-d"])
@pytest.mark.parametrize(
    "cls, make, widths",
    [(LlamaForCausalLMEagle, make_eagle_checkpoint, "64"),
     (LlamaForCausalLMEagle3, lambda t, d: make_eagle3_checkpoint(t, d, layer_ids=LAYERS), "one of (192, 64)")],
    ids=["EAGLE", "EAGLE3"],
)
def test_a_head_refuses_features_of_another_shape_naming_the_field(spec_target, tmp_path, cls, make, widths, shape):
    """Both heads check ``spec_hidden_states`` the one way (the EAGLE head's), before any compute:
    the target's last state (hidden 64) for EAGLE; its three fused aux states or the head's own
    f_hat for EAGLE-3."""
    head = cls(ModelConfig.from_pretrained(make(spec_target, tmp_path / "head"), dtype="float32"))
    batch = SimpleNamespace(spec_hidden_states=None if shape is None else torch.zeros(shape))
    got = None if shape is None else shape
    with pytest.raises(ValueError, match=re.escape(f"spec_hidden_states must be (3, {widths}), got {got}")):
        head(torch.zeros(3, dtype=torch.long), torch.arange(3), batch)


@pytest.mark.slow
def test_sampled_output_follows_the_targets_distribution(cycle_target, tmp_path):
    perfect = make_cycle_eagle3_checkpoint(cycle_target, tmp_path / "perfect", CYCLE, LAYERS)
    check_sampled_distribution(cycle_target, _flags(perfect), n=300)  # EAGLE's test at half the cost


def test_weight_update_changes_target_and_head_together(spec_target, cycle_target, tmp_path):
    from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqInput

    random_head = make_eagle3_checkpoint(spec_target, tmp_path / "random", layer_ids=LAYERS)
    perfect = make_cycle_eagle3_checkpoint(cycle_target, tmp_path / "perfect", CYCLE, LAYERS)
    new = greedy("new", CYCLE * 3, 24)
    update = UpdateWeightsFromDiskReqInput(model_path=str(cycle_target), revision="b", draft_model_path=str(perfect))
    expected, _ = run(cycle_target, {0: [new]}, None)
    spec, scheduler = run(spec_target, {0: [update], 1: [new]}, _flags(random_head))
    assert update_replies(scheduler)[0].success is True
    assert scheduler.speculative.stats.verify_steps > 0
    assert spec["new"]["ids"] == expected["new"]["ids"]
    head = scheduler.worker.draft_worker
    assert head.runner.model_config.model_path == str(perfect)
    assert head.head.d2t.tolist() == make_d2t(perfect), "the new head's vocabulary map serves"
    stats = scheduler.speculative.stats
    assert stats.accepted_tokens == stats.draft_tokens, "the new head agrees with the new target"


def make_d2t(path) -> list[int]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))["d2t"].tolist()


def test_an_update_to_a_head_of_other_aux_layers_is_refused(spec_target, tmp_path):
    from shardline_runtime.managers.io_struct import UpdateWeightsFromDiskReqInput

    head3 = make_eagle3_checkpoint(spec_target, tmp_path / "head", layer_ids=LAYERS)
    other = make_eagle3_checkpoint(spec_target, tmp_path / "other", layer_ids=[0, 0, 1])
    update = UpdateWeightsFromDiskReqInput(model_path=str(spec_target), revision="b", draft_model_path=str(other))
    _, scheduler = run(spec_target, {0: [update]}, _flags(head3))
    reply = update_replies(scheduler)[0]
    assert reply.success is False
    assert "eagle_aux_hidden_state_layer_ids selects target layers [0, 0, 1]" in reply.message
    assert "this server captures [0, 1, 1]" in reply.message
