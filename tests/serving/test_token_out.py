"""token_out alone: per-request step records built from the scheduler's ``Req`` objects."""

from __future__ import annotations

from shardline_runtime.managers.io_struct import (
    FinishReason,
    TokenLogprob,
    Usage,
)
from shardline_runtime.managers.req import Req
from shardline_runtime.managers.token_out import build_token_outs, rejected_token_out
from shardline_runtime.sampling.sampling_params import SamplingParams


def _req(rid: str = "r", **kw) -> Req:
    return Req(rid, [5, 6, 7], SamplingParams(max_new_tokens=3), eos_token_ids=[2], **kw)


def test_each_record_carries_only_the_tokens_since_the_last_one():
    req = _req()
    req.append_output(11)
    req.append_output(12)
    first = build_token_outs([req])
    req.append_output(13)
    second = build_token_outs([req])
    assert first[0].ids == [11, 12]
    assert second[0].ids == [13]


def test_usage_counts_the_whole_request_so_far():
    req = _req()
    req.cached_tokens = 2
    req.append_output(11)
    build_token_outs([req])
    req.append_output(12)
    (out,) = build_token_outs([req])
    assert out.usage == Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=2)


def test_a_request_with_no_news_is_skipped():
    assert build_token_outs([_req()]) == []


def test_a_finish_without_new_tokens_is_sent_typed():
    req = _req()
    req.finished_reason = FinishReason("abort", message="aborted by /abort_request")
    (out,) = build_token_outs([req])
    assert out.ids == []
    assert out.finish == FinishReason("abort", message="aborted by /abort_request")


def test_logprobs_pair_with_their_tokens_and_top_alternatives():
    req = _req(return_logprob=True, top_logprobs_num=2)
    req.append_output(11, -0.5, ([-0.5, -1.5], [11, 30]))
    req.append_output(12, -0.25, ([-0.25, -2.0], [12, 31]))
    (out,) = build_token_outs([req])
    assert out.logprobs == [TokenLogprob(-0.5, 11, [(-0.5, 11), (-1.5, 30)]),
                            TokenLogprob(-0.25, 12, [(-0.25, 12), (-2.0, 31)])]


def test_no_logprobs_unless_asked():
    req = _req()
    req.append_output(11)
    assert build_token_outs([req])[0].logprobs == []


def test_prompt_logprobs_are_sent_once_with_none_for_the_unscored_first_token():
    req = _req(return_logprob=True, logprob_start_len=0)
    req.prompt_logprobs = [(1, -3.0, []), (2, -2.0, [])]
    req.append_output(11, -0.5)
    (first,) = build_token_outs([req])
    req.append_output(12, -0.5)
    (second,) = build_token_outs([req])
    assert first.prompt_logprobs == [TokenLogprob(None, 5), TokenLogprob(-3.0, 6), TokenLogprob(-2.0, 7)]
    assert second.prompt_logprobs is None


def test_a_request_that_never_ran_is_answered_with_an_abort_and_its_prompt_length():
    out = rejected_token_out("x", 4, "too long")
    assert out.finish == FinishReason("abort", message="too long")
    assert out.usage == Usage(4, 0, 0)


def test_finish_reasons_keep_sglangs_meta_info_shape():
    assert FinishReason("stop", 2).to_dict() == {"type": "stop", "matched": 2}
    assert FinishReason("length", 30).to_dict() == {"type": "length", "length": 30}
    assert FinishReason("abort", message="gone").to_dict() == {"type": "abort", "message": "gone"}
