"""StepDetokenizer and the receiver thread: a step's records become chunks, received and
decoded off the event loop (RequestStreams on real ZMQ sockets)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq

from shardline_runtime.managers.io_struct import (
    BatchTokenOut,
    FinishReason,
    TokenizedGenerateReqInput,
    TokenLogprob,
    TokenOut,
    Usage,
)
from shardline_runtime.managers.request_streams import RequestStreams
from shardline_runtime.managers.step_detokenizer import StepDetokenizer, detokenize_out
from shardline_runtime.sampling.sampling_params import SamplingParams
from shardline_runtime.weights_state import WeightsState


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from shardline_runtime.tiny_checkpoint import train_tokenizer

    return train_tokenizer(tmp_path_factory.mktemp("tok"))


def _out(ids, finish=None, **kw) -> TokenOut:
    return TokenOut(rid="r", ids=list(ids), usage=Usage(3, 0, 1), finish=finish, **kw)


def test_the_chunks_of_a_request_join_into_its_text(tokenizer):
    ids = tokenizer.encode("hello world 机器学习 🙂")
    steps = StepDetokenizer(tokenizer)
    detok = steps.new_request([], (), True, False)
    chunks = [detokenize_out(detok, _out([t]))[0] for t in ids[:-1]]
    chunks.append(detokenize_out(detok, _out(ids[-1:], FinishReason("length", len(ids))))[0])
    assert "".join(c.text for c in chunks) == tokenizer.decode(ids)
    assert chunks[-1].usage == Usage(3, len(ids), 1)


def test_a_stop_string_across_steps_finishes_the_request_and_asks_to_free_it(tokenizer):
    ids = tokenizer.encode("one two three four")
    steps = StepDetokenizer(tokenizer)
    detok = steps.new_request([], ["three"], True, False)
    results = [detokenize_out(detok, _out([t])) for t in ids]
    stopped = [(chunk, free) for chunk, free in results if chunk.finish is not None]
    assert stopped[0][0].finish == FinishReason("stop", "three")
    assert stopped[0][1] is True
    assert "three" not in "".join(chunk.text for chunk, _ in results)


def test_logprobs_are_cut_to_the_tokens_consumed_before_a_stop(tokenizer):
    ids = tokenizer.encode("one two three four")
    steps = StepDetokenizer(tokenizer)
    detok = steps.new_request([], ["two"], True, False)
    lps = [TokenLogprob(-1.0, t) for t in ids]
    chunk, _ = detokenize_out(detok, _out(ids, logprobs=lps))
    assert len(chunk.logprobs) == len(chunk.token_ids)
    assert len(chunk.token_ids) < len(ids)


def _streams(tokenizer, tmp_path, on_message, weights):
    """A real RequestStreams on IPC sockets, and the scheduler's two ends (PULL, PUSH)."""
    ctx = zmq.Context()
    scheduler_in = ctx.socket(zmq.PULL)
    scheduler_in.bind(f"ipc://{tmp_path}/in")
    streams = RequestStreams(
        tokenizer, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", on_message, weights
    )
    scheduler_out = ctx.socket(zmq.PUSH)
    scheduler_out.connect(f"ipc://{tmp_path}/out")
    return ctx, streams, scheduler_in, scheduler_out


def _request(rid, ids, stop=None):
    return TokenizedGenerateReqInput(
        rid=rid, input_ids=ids, sampling_params=SamplingParams(stop=stop or [])
    )


def test_a_step_is_received_and_decoded_off_the_event_loop_thread_in_arrival_order(
    tokenizer, tmp_path
):
    """The receiver thread decodes; a WeightsState sent before a step stamps that step's chunks;
    a stop string matched in the HTTP process asks the scheduler to free the request."""
    served = [WeightsState(model_path="m", weight_version="v1")]
    ctx, streams, scheduler_in, scheduler_out = _streams(
        tokenizer, tmp_path, lambda msg: served.append(msg), lambda: served[-1]
    )
    threads = set()
    decode = streams.detokenizer.tokenizer.decode

    def recording_decode(*args, **kw):
        threads.add(threading.get_ident())
        return decode(*args, **kw)

    streams.detokenizer.tokenizer.decode = recording_decode
    ids = tokenizer.encode("hello world one two")

    async def main():
        streams.start()
        a = await streams.open(_request("a", [5, 6]))
        b = await streams.open(_request("b", [5, 6], stop=["two"]))
        assert [scheduler_in.recv_pyobj().rid for _ in range(2)] == ["a", "b"]
        scheduler_out.send_pyobj(
            BatchTokenOut([TokenOut(rid="a", ids=ids[:2], usage=Usage(2, 2, 0))])
        )
        scheduler_out.send_pyobj(WeightsState(model_path="m", weight_version="v2"))
        scheduler_out.send_pyobj(
            BatchTokenOut(
                [
                    TokenOut(
                        rid="a",
                        ids=ids[2:],
                        usage=Usage(2, len(ids), 0),
                        finish=FinishReason("length", len(ids)),
                    ),
                    TokenOut(rid="b", ids=ids, usage=Usage(2, len(ids), 0)),
                ]
            )
        )
        first, last = (
            await asyncio.wait_for(a.queue.get(), 30),
            await asyncio.wait_for(a.queue.get(), 30),
        )
        stopped = await asyncio.wait_for(b.queue.get(), 30)
        abort = await asyncio.get_running_loop().run_in_executor(None, scheduler_in.recv_pyobj)
        return threading.get_ident(), first, last, stopped, abort

    try:
        loop_thread, first, last, stopped, abort = asyncio.run(main())
    finally:
        streams.close()
        ctx.destroy(0)
    assert threads and loop_thread not in threads
    assert (first.weight_version, last.weight_version) == ("v1", "v2")
    assert first.text + last.text == tokenizer.decode(ids)
    assert last.finish == FinishReason("length", len(ids))
    assert stopped.finish == FinishReason("stop", "two") and "two" not in stopped.text
    assert (abort.rid, abort.finish_reason["type"]) == ("b", "stop")


def test_logprob_tokens_get_their_texts_with_the_step(tokenizer):
    ids = tokenizer.encode("hello world")
    steps = StepDetokenizer(tokenizer)
    detok = steps.new_request([], (), True, False)
    lps = [TokenLogprob(-1.0, t, [(-1.0, t), (-2.0, 3)]) for t in ids]
    ((chunk, _),) = steps.step([(detok, _out(ids, logprobs=lps))])
    assert chunk.token_texts == {
        t: tokenizer.decode([t], skip_special_tokens=False) for t in [*ids, 3]
    }
