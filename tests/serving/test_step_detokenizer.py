"""StepDetokenizer alone: a step's records become chunks, decoded in a worker thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from shardline_runtime.managers.io_struct import FinishReason, TokenLogprob, TokenOut, Usage
from shardline_runtime.managers.step_detokenizer import StepDetokenizer, detokenize_out


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


def test_a_step_is_decoded_off_the_event_loop_thread(tokenizer):
    steps = StepDetokenizer(tokenizer)
    threads = set()
    decode = steps.tokenizer.decode

    def recording_decode(*args, **kw):
        threads.add(threading.get_ident())
        return decode(*args, **kw)

    steps.tokenizer.decode = recording_decode

    async def main():
        detok = steps.new_request([], (), True, False)
        chunks = await steps.run_step([(detok, _out(tokenizer.encode("hello world")))])
        return threading.get_ident(), chunks

    loop_thread, chunks = asyncio.run(main())
    steps.close()
    assert chunks[0][0].text == "hello world"
    assert threads
    assert loop_thread not in threads


def test_logprob_tokens_get_their_texts_in_the_worker_thread(tokenizer):
    ids = tokenizer.encode("hello world")
    steps = StepDetokenizer(tokenizer)

    async def main():
        detok = steps.new_request([], (), True, False)
        lps = [TokenLogprob(-1.0, t, [(-1.0, t), (-2.0, 3)]) for t in ids]
        return await steps.run_step([(detok, _out(ids, logprobs=lps))])

    ((chunk, _),) = asyncio.run(main())
    steps.close()
    assert chunk.token_texts == {t: tokenizer.decode([t], skip_special_tokens=False) for t in [*ids, 3]}
