"""Sampler, SamplingParams and SamplingBatchInfo (field case R4, seeds, penalties, logprobs)."""

from __future__ import annotations

import math

import pytest
import torch

from shardline_runtime.layers.sampler import (
    HOST_ID_RING,
    HostIdRing,
    Sampler,
    greedy_argmax,
    greedy_on_host,
)
from shardline_runtime.managers.req import Req
from shardline_runtime.sampling import SamplingBatchInfo, SamplingParams, SamplingParamsError

VOCAB = 16


def make_reqs(*params: SamplingParams, prompt=(1, 2, 3)):
    return [Req(f"r{i}", list(prompt), p) for i, p in enumerate(params)]


def info_for(*params: SamplingParams, vocab=VOCAB, prompt=(1, 2, 3)):
    return SamplingBatchInfo.from_reqs(make_reqs(*params, prompt=prompt), vocab, "cpu")


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 1.5), ("top_p", -0.1),
        ("top_k", -2), ("top_k", 2.5), ("min_p", 2.0), ("repetition_penalty", 0.0),
        ("frequency_penalty", 2.5), ("presence_penalty", -3), ("max_new_tokens", -1),
        ("seed", -1), ("stop_token_ids", [-1]), ("stop", [""]), ("ignore_eos", 1), ("temperature", True),
    ],
)
def test_bad_params_name_the_field(field, value):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field
    assert field in str(err.value)


def test_unknown_key_and_vocab_check():
    with pytest.raises(SamplingParamsError, match="tempreature"):
        SamplingParams.from_dict({"tempreature": 1.0})
    with pytest.raises(SamplingParamsError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[VOCAB]).verify_vocab(VOCAB)


def test_top_k_disabled_and_clamped():
    assert SamplingParams(top_k=-1).effective_top_k(VOCAB) == VOCAB
    assert SamplingParams(top_k=0).effective_top_k(VOCAB) == VOCAB
    assert SamplingParams(top_k=10**6).effective_top_k(VOCAB) == VOCAB
    assert SamplingParams(top_k=1).is_greedy and SamplingParams(top_p=0.0).is_greedy


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, top_k=5, top_p=0.5),
        SamplingParams(temperature=0.8, top_k=1),
        SamplingParams(temperature=0.8, top_p=0.0),
    ],
)
def test_greedy_cases_take_argmax(params):
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    out = Sampler()(logits, info_for(*[params] * 4))
    assert torch.equal(out.next_token_ids, logits.argmax(-1))


def test_disabled_top_k_gives_diverse_samples_and_no_nan():
    logits = torch.zeros(64, VOCAB)
    logits[:, 0] = float("-inf")  # a masked column must never be drawn
    for top_k in (-1, 0, 10**6):
        out = Sampler()(logits, info_for(*[SamplingParams(temperature=0.8, top_k=top_k)] * 64))
        ids = out.next_token_ids
        assert len(set(ids.tolist())) > 4 and not (ids == 0).any()


def test_truncation_keeps_only_allowed_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)] * 256))
    cases = {
        SamplingParams(top_k=2): {0, 1},
        SamplingParams(top_p=0.79): {0, 1},
        SamplingParams(min_p=0.5): {0, 1},
        SamplingParams(top_p=0.9, top_k=3): {0, 1, 2},
    }
    for params, allowed in cases.items():
        got = set(Sampler()(logits, info_for(*[params] * 256)).next_token_ids.tolist())
        assert got == allowed, params


def test_extreme_logits_never_nan():
    logits = torch.full((3, VOCAB), -1e30)
    logits[:, 3] = 1e30
    params = [SamplingParams(temperature=1e-4), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)]
    out = Sampler()(logits, info_for(*params), return_logprob=True)
    assert out.next_token_ids.tolist() == [3, 3, 3]
    assert not torch.isnan(out.next_token_logprobs).any()


def test_padded_vocab_columns_never_sampled():
    logits = torch.zeros(32, VOCAB + 4)
    logits[:, VOCAB:] = 100.0  # TP padding columns; the sampler must cut them off
    ids = Sampler()(logits, info_for(*[SamplingParams()] * 32)).next_token_ids
    assert int(ids.max()) < VOCAB


def run_steps(sampler, reqs, logits_fn, steps):
    info = SamplingBatchInfo.from_reqs(reqs, VOCAB, "cpu")
    tokens = []
    for step in range(steps):
        tokens.append(sampler(logits_fn(len(reqs), step), info).next_token_ids.tolist())
    return tokens


def test_seeded_request_same_alone_and_batched():
    base = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))

    def logits_fn(bs, step):
        return base.expand(bs, VOCAB) + 0.1 * step

    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [t[0] for t in run_steps(Sampler(), make_reqs(seeded), logits_fn, 12)]
    torch.manual_seed(99)
    batched_reqs = make_reqs(SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.7))
    batched = [t[1] for t in run_steps(Sampler(), batched_reqs, logits_fn, 12)]
    assert alone == batched
    other_seed = [t[0] for t in run_steps(Sampler(), make_reqs(SamplingParams(seed=4321)), logits_fn, 12)]
    assert other_seed != alone


def reference_penalties(logits, prompt, output, repetition, frequency, presence):
    """vLLM's order, written out per token (vllm/model_executor/layers/utils.py,
    ``apply_penalties``): the repetition penalty on every token seen in the prompt or the
    output first, then the OpenAI frequency and presence penalties on output tokens."""
    out = []
    for token, logit in enumerate(logits):
        if token in prompt or token in output:
            logit = logit / repetition if logit > 0 else logit * repetition
        count = output.count(token)
        out.append(logit - frequency * count - presence * (count > 0))
    return out


def test_penalties_follow_vllm_order():
    row = [2.0, -1.0, 0.5, 0.0, 3.0, -2.0] + [0.0] * (VOCAB - 6)
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    req = Req("r", [0, 4], params)  # tokens 0 and 4 in the prompt
    req.output_ids = [1, 1, 2, 4]
    info = SamplingBatchInfo.from_reqs([req], VOCAB, "cpu")
    got = info.penalties.apply(torch.tensor([row]))[0].tolist()
    # By hand, repetition first: token 1: -1 * 2 = -2, then - 0.5 * 2 - 0.25 = -3.25;
    # token 2: 0.5 / 2 = 0.25, then - 0.5 - 0.25 = -0.5 (frequency first would give -4.5 and -0.5).
    assert got[:4] == pytest.approx([1.0, -3.25, -0.5, 0.0])
    assert got == pytest.approx(reference_penalties(row, [0, 4], [1, 1, 2, 4], 2.0, 0.5, 0.25))
    info.penalties.cumulate_output_tokens(torch.tensor([3]))
    got = info.penalties.apply(torch.tensor([row]))[0].tolist()
    assert got[3] == pytest.approx(-0.75)  # 0 is unchanged by the repetition penalty, then -0.5 - 0.25
    assert got == pytest.approx(reference_penalties(row, [0, 4], [1, 1, 2, 4, 3], 2.0, 0.5, 0.25))


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5), SamplingParams(temperature=0.0)]
    out = Sampler()(logits, info_for(*params), return_logprob=True, top_logprobs_nums=[3, 0])
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(out.next_token_logprobs, raw.gather(-1, out.next_token_ids[:, None]).squeeze(-1))
    values, ids = raw[0].topk(3)
    assert out.top_logprobs_idx == [ids.tolist(), []]
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(out.top_logprobs_val[0], values.tolist()))


def test_filter_and_merge_keep_rows_aligned():
    a = info_for(SamplingParams(temperature=0.0), SamplingParams(top_k=3, seed=7))
    b = info_for(SamplingParams(presence_penalty=1.0))
    a.merge_batch(b)
    assert a.batch_size == 3 and a.penalties.frequency.shape == (3,) and not a.all_greedy
    a.filter_batch([0, 2])
    assert a.batch_size == 2 and a.generators == [None, None]
    assert a.penalties.presence.tolist() == [0.0, 1.0] and a.is_greedy.tolist() == [True, False]
    assert not a.need_top_k
    a.filter_batch([0])
    assert a.all_greedy


def test_batch_size_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(3, VOCAB), info_for(SamplingParams()))


def test_zero_exponential_draw_cannot_pick_a_truncated_token(monkeypatch):
    """A race value of exactly 0 must not make a zero-probability token win (0/0 = NaN)."""
    logits = torch.tensor([[5.0, 4.0] + [0.0] * (VOCAB - 2)])
    real = torch.Tensor.exponential_

    def zero_first_then_real(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self[..., -1] = 0.0  # the last token is outside top_k=2
        return self

    monkeypatch.setattr(torch.Tensor, "exponential_", zero_first_then_real)
    for _ in range(20):
        ids = Sampler()(logits, info_for(SamplingParams(top_k=2))).next_token_ids
        assert int(ids) in (0, 1)



def test_tiny_positive_temperature_is_greedy_and_extreme_penalty_stays_finite():
    """Attack cases: temperature 1e-45 and repetition_penalty 1e-300 are both 0 in float32."""
    assert SamplingParams(temperature=1e-45).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy
    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB)
    logits[1, 5], logits[1, 6] = 2.0, 1.0  # positive seen logits / 0 -> +inf
    info = info_for(
        SamplingParams(temperature=1e-45),
        SamplingParams(temperature=1.0, repetition_penalty=1e-300, seed=3),
        prompt=(5, 6),
    )
    out = Sampler()(logits, info).next_token_ids
    assert int(out[0]) == int(logits[0].argmax())
    # the penalised seen tokens go to +inf; they must win, not turn into NaN and a pick of id 0
    assert int(out[1]) in (5, 6)


@pytest.mark.parametrize("bs", [1, 64])
def test_greedy_argmax_on_the_cpu_equals_torch_max_first_index_on_ties(bs):
    g = torch.Generator().manual_seed(bs)
    logits = torch.randint(-3, 4, (bs, 32000), generator=g).float()  # many ties per row
    logits[0, 7] = float("nan")  # NaN counts as the largest, as in torch
    assert torch.equal(greedy_argmax(logits), logits.max(dim=-1).indices)


def test_greedy_argmax_of_a_padded_vocab_slice_is_an_int64_tensor():
    logits = torch.randn(3, 40)[:, :32]  # a strided view, as after dropping padded columns
    ids = greedy_argmax(logits)
    assert ids.dtype == torch.int64
    assert torch.equal(ids, logits.max(dim=-1).indices)


def test_greedy_on_host_writes_a_ring_slot_that_stays_for_the_next_steps():
    """Each step's ids equal torch's argmax; a step's ids (tensor and NumPy view, one memory)
    stay unchanged while the next HOST_ID_RING - 1 steps write theirs; a batch larger than the
    ring grows it; non-CPU-float32 logits are refused (None)."""
    ring = HostIdRing(capacity=2)
    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(bs, 50, generator=g) for bs in (1, 3, 3, 2, 3)]
    got = [greedy_on_host(logits, logits.shape[0], 50, ring) for logits in steps]
    for logits, (ids, host) in zip(steps[-HOST_ID_RING:], got[-HOST_ID_RING:]):
        assert ids.dtype == torch.int64 and host.tolist() == ids.tolist()
        assert torch.equal(ids, logits.max(dim=-1).indices)
    ids, host = greedy_on_host(steps[0], 1, 50)  # no ring: a new array
    assert torch.equal(ids, steps[0].max(dim=-1).indices)
    assert greedy_on_host(steps[0].double(), 1, 50, ring) is None
    assert greedy_on_host(steps[1], 2, 50, ring) is None  # rows disagree
