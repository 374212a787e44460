"""IncrementalDetokenizer: UTF-8 safety (R6) and stop strings across token boundaries (R5)."""

import pytest

from shardline_runtime.managers.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from shardline_runtime.tiny_checkpoint import train_tokenizer

    return train_tokenizer(tmp_path_factory.mktemp("tok"))


TEXTS = [
    "hello world 机器学习 模型 🙂🚀 naïve café",
    "日本語 テキスト 🎉✨ the quick brown fox",
    "😀😀😀 Привет Ωμέγα",
]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_of_single_tokens_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode("the model")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add_tokens([t]) for t in ids]
    deltas.append(detok.finish())
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_char_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🤖")
    assert len(ids) > 1  # byte-level pieces of one character
    detok = IncrementalDetokenizer(tokenizer, [])
    outs = [detok.add_tokens([t]) for t in ids]
    assert outs[:-1] == [""] * (len(ids) - 1) and outs[-1] == "🤖"


def test_stop_string_across_tokens_is_cut_and_never_streamed(tokenizer):
    text = "hello world how are you today"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([i]) for i in ids]
    # a stop string beginning mid-token and ending in the next token
    stop = pieces[1][-2:] + pieces[2][:2]
    assert stop in text
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop])
    streamed = ""
    for t in ids:
        streamed += detok.add_tokens([t])
        assert stop not in streamed
        assert streamed == detok.text[: len(streamed)]
    streamed += detok.finish()
    assert detok.matched_stop == stop
    assert streamed == text[: text.index(stop)]
    assert detok.num_tokens == 3


def test_include_stop_and_exclude_last_token(tokenizer):
    ids = tokenizer.encode("one two three four")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["three"], include_stop_str_in_output=True)
    out = detok.add_tokens(ids) + detok.finish()
    assert out == "one two three"
    detok = IncrementalDetokenizer(tokenizer, [])
    out = detok.add_tokens(ids + [2], exclude_last=True) + detok.finish()
    assert out == "one two three four" and detok.num_tokens == len(ids) + 1


def test_held_back_tail_released_at_finish(tokenizer):
    ids = tokenizer.encode("one two thr")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["three"])
    first = detok.add_tokens(ids)
    assert not first.endswith("thr")
    assert first + detok.finish() == "one two thr"


@pytest.mark.parametrize("text", TEXTS)
def test_token_offsets_index_the_text(tokenizer, text):
    """Offsets (completions ``text_offset``): each token's text starts at its offset; the byte
    pieces of one character all start where the character does."""
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [])
    for t in ids:
        detok.add_tokens([t])
    detok.finish()
    assert len(detok.token_offsets) == len(ids)
    for k, (offset, t) in enumerate(zip(detok.token_offsets, ids)):
        whole = tokenizer.decode([t]).rstrip("\ufffd")  # its complete characters
        if whole:
            assert detok.text[offset:].startswith(whole)
        else:  # only bytes of a character split over tokens: it starts at that character
            assert offset == len(tokenizer.decode(ids[:k]).rstrip("\ufffd"))


def test_token_offsets_after_an_invalid_byte_sequence(tokenizer):
    """A lone continuation byte never completes: U+FFFD is emitted with the next token, whose own
    text starts after it."""
    lone = next(t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]) == "\ufffd")
    ids = [lone] + tokenizer.encode("hello")
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.add_tokens(ids)
    assert detok.text.startswith("\ufffd") and detok.token_offsets[:2] == [0, 1]
