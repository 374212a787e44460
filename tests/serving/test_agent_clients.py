"""Real agent clients, unchanged, pointed at ``base_url`` of a server on a random tiny model: the
openai SDK (``parse`` with a Pydantic tool, tools while streaming), LangChain's ``ChatOpenAI``
(``bind_tools``, ``with_structured_output``) and the OpenAI Agents SDK (one tool round trip).
Forced calls (``tool_choice`` required / named) and JSON schemas make a random model's replies
valid, which is what makes these deterministic."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field


class GetWeather(BaseModel):
    """Weather forecast for a city."""

    city: str = Field(pattern="^[a-z]{1,6}$")
    days: int = Field(ge=1, le=7)


class City(BaseModel):
    city: str = Field(pattern="^[a-z]{1,6}$")
    capital: bool


MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def openai_client(tools_server):
    from openai import OpenAI

    return OpenAI(base_url=tools_server.url + "/v1", api_key="none")


def test_openai_parse_returns_the_pydantic_tool_arguments(openai_client):
    from openai import pydantic_function_tool

    completion = openai_client.chat.completions.parse(
        model="tiny-tools", messages=MESSAGES, tools=[pydantic_function_tool(GetWeather)], tool_choice="required",
        parallel_tool_calls=False, max_tokens=160, temperature=1.0, seed=11)
    call = completion.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_openai_stream_with_tools_assembles_the_call(openai_client):
    from openai import pydantic_function_tool

    with openai_client.chat.completions.stream(
            model="tiny-tools", messages=MESSAGES, tools=[pydantic_function_tool(GetWeather)],
            tool_choice={"type": "function", "function": {"name": "GetWeather"}}, parallel_tool_calls=False,
            max_tokens=160,
            temperature=1.0, seed=12) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
    assert isinstance(done[0].parsed_arguments, GetWeather)


@pytest.fixture(scope="module")
def chat_model(tools_server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=tools_server.url + "/v1", api_key="none", model="tiny-tools", max_tokens=160,
                      temperature=1.0, seed=13)


def test_langchain_bind_tools_answers_a_valid_tool_call(chat_model):
    message = chat_model.bind_tools([GetWeather], tool_choice="GetWeather", parallel_tool_calls=False).invoke("Weather in Oslo?")
    call = message.tool_calls[0]
    assert isinstance(GetWeather(**call["args"]), GetWeather)


def test_langchain_streamed_tool_call_chunks_merge_into_a_call(chat_model):
    bound = chat_model.bind_tools([GetWeather], tool_choice="any", parallel_tool_calls=False)
    merged = None
    for chunk in bound.stream("Weather in Oslo?"):
        merged = chunk if merged is None else merged + chunk
    assert isinstance(GetWeather(**merged.tool_calls[0]["args"]), GetWeather)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_returns_the_model(chat_model, method):
    assert isinstance(chat_model.with_structured_output(City, method=method).invoke("A city?"), City)


def test_agents_sdk_runs_one_tool_round_trip(tools_server):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    asked: list[str] = []

    @agents.function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The current time in a time zone."""
        asked.append(zone)
        return "12:00"

    class Answer(BaseModel):
        time: Literal["12:00", "13:00"]

    model = agents.OpenAIChatCompletionsModel(
        model="tiny-tools", openai_client=AsyncOpenAI(base_url=tools_server.url + "/v1", api_key="none"))
    agent = agents.Agent(name="clock", instructions="Tell the time.", tools=[get_time], output_type=Answer,
                         model=model, model_settings=agents.ModelSettings(tool_choice="required", max_tokens=160,
                                                                          parallel_tool_calls=False, temperature=1.0))
    result = agents.Runner.run_sync(agent, "What time is it?", max_turns=4)
    assert (len(asked) >= 1, isinstance(result.final_output, Answer)) == (True, True)
