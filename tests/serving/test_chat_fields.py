"""Chat fields that change the output are honoured or refused, never dropped (field case G14):
``chat_template_kwargs`` reaches the chat template; the legacy ``functions`` / ``function_call``,
``reasoning_effort``, ``audio``, non-text ``modalities`` ... are 400s naming the field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardline_runtime.entrypoints.chat_messages import chat_prompt_ids
from shardline_runtime.entrypoints.protocol import ChatCompletionRequest
from shardline_runtime.managers.io_struct import SchedulerInfo
from shardline_runtime.managers.request_validation import RequestValidationError, RequestValidator
from shardline_runtime.weights_state import WeightsState

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("field", "value"), [
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
    ("function_call", "auto"),
    ("reasoning_effort", "low"),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("web_search_options", {}),
])
def test_fields_that_would_change_the_output_are_400_naming_them(server, field, value):
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize(("field", "value"), [("modalities", ["text"]), ("prediction", {"type": "content", "content": "x"}),
                                              ("user", "u1")])
def test_fields_that_change_nothing_written_are_accepted(server, field, value):
    r = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, field: value})
    assert r.status_code == 200, r.text


def test_a_reserved_chat_template_kwarg_is_400_naming_chat_template_kwargs(server):
    body = {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"add_generation_prompt": False}}
    r = server.post("/v1/chat/completions", body)
    assert r.json()["error"]["param"] == "chat_template_kwargs"


@pytest.fixture(scope="module")
def thinking_tm(tiny_checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_checkpoint("qwen3", 0)))
    tokenizer.chat_template = THINKING_TEMPLATE
    info = SchedulerInfo(tp_rank=0, max_total_num_tokens=4096, max_req_len=4096, max_req_input_len=4096,
                         context_len=4096, vocab_size=512, max_running_requests=8,
                         weights=WeightsState(model_path="x"))
    return SimpleNamespace(tokenizer=tokenizer, validator=RequestValidator(tokenizer, info))


def test_chat_template_kwargs_reach_the_template(thinking_tm):
    plain = chat_prompt_ids(ChatCompletionRequest(messages=MESSAGES), thinking_tm)
    off = chat_prompt_ids(ChatCompletionRequest(messages=MESSAGES, chat_template_kwargs={"enable_thinking": False}),
                          thinking_tm)
    assert thinking_tm.tokenizer.decode(off).endswith("<think>\n\n</think>\n\n")
    assert thinking_tm.tokenizer.decode(off).startswith(thinking_tm.tokenizer.decode(plain))


def test_a_reserved_template_kwarg_is_refused_before_rendering(thinking_tm):
    req = ChatCompletionRequest(messages=MESSAGES, chat_template_kwargs={"tokenize": True})
    with pytest.raises(RequestValidationError) as err:
        chat_prompt_ids(req, thinking_tm)
    assert err.value.param == "chat_template_kwargs"
