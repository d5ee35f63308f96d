"""Structured outputs and tool calls through the OpenAI-compatible server, with the official
openai client: response_format, vLLM's structured_outputs and guided_* fields, tools with
every tool_choice, tool_calls in whole responses and stream deltas, tool results round
trip, and clear 400s for constraints that cannot be honoured."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagedrag import EngineArgs
from pagedrag.entrypoints.async_engine import AsyncLLMEngine
from pagedrag.server.app import build_app
from pagedrag.server.background import BackgroundServer
from pagedrag.server.serving import ServerConfig
from schema_corpus import RAG_ANSWER, SCHEMAS

MODEL = "smol"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search_docs", "description": "Search the documentation",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40},
                                                    "top_k": {"type": "integer", "minimum": 1, "maximum": 10}},
                   "required": ["query"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client():
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(max_model_len=1024, max_num_seqs=8, seed=0))
    with BackgroundServer(build_app(engine, ServerConfig(served_model_names=[MODEL]))) as server:
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    engine.shutdown()


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=kwargs.pop("messages", ASK),
                                          temperature=kwargs.pop("temperature", 0),
                                          max_tokens=kwargs.pop("max_tokens", 160), **kwargs)


def arguments_of(call, tool: dict) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_response_format_json_schema_and_json_object(client):
    schema = SCHEMAS["grade_document"]
    reply = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "grade", "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    reply = chat(client, response_format={"type": "json_object"}, max_tokens=300, n=2, temperature=0.7, seed=3)
    assert all(isinstance(json.loads(c.message.content), (dict, list))
               for c in reply.choices if c.finish_reason == "stop")
    # the completions route takes it too, as vLLM's does (not ignored)
    completion = client.completions.create(model=MODEL, prompt="A document's grade as JSON:", max_tokens=160,
                                           temperature=0, extra_body={"response_format": {
                                               "type": "json_schema", "json_schema": {"name": "grade", "schema": schema}}})
    jsonschema.validate(json.loads(completion.choices[0].text), schema)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"json": RAG_ANSWER}}, lambda t: jsonschema.validate(json.loads(t), RAG_ANSWER)),
    ({"guided_json": RAG_ANSWER}, lambda t: jsonschema.validate(json.loads(t), RAG_ANSWER)),
    ({"guided_choice": ["sunny", "rainy"]}, lambda t: t in ("sunny", "rainy") or pytest.fail(t)),
    ({"guided_regex": "[0-9]{1,2} degrees"}, lambda t: t.endswith(" degrees") or pytest.fail(t)),
    ({"structured_outputs": {"grammar": 'root ::= "It is " ("hot" | "cold") "."'}},
     lambda t: t in ("It is hot.", "It is cold.") or pytest.fail(t)),
])
def test_vllm_constraint_fields(client, extra, check):
    check(chat(client, extra_body=extra).choices[0].message.content)
    # the completions route takes them too
    text = client.completions.create(model=MODEL, prompt="The weather today:", max_tokens=160, temperature=0,
                                     extra_body=extra).choices[0].text
    check(text)


def test_named_tool_choice_returns_a_valid_call(client):
    reply = chat(client, tools=[WEATHER, SEARCH],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments_of(call, WEATHER)
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_choice(client, parallel):
    reply = chat(client, tools=[WEATHER, SEARCH], tool_choice="required", parallel_tool_calls=parallel)
    calls = reply.choices[0].message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        arguments_of(call, {"get_weather": WEATHER, "search_docs": SEARCH}[call.function.name])


def test_auto_and_none(client):
    auto = chat(client, tools=[WEATHER], tool_choice="auto", max_tokens=60).choices[0]
    assert auto.message.content or auto.message.tool_calls  # the model decides
    none = chat(client, tools=[WEATHER], tool_choice="none", max_tokens=30).choices[0]
    assert none.message.tool_calls == [] and none.finish_reason in ("stop", "length")


def test_streamed_tool_calls_and_usage(client):
    stream = chat(client, tools=[WEATHER], tool_choice="required", stream=True,
                  stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0] for c in chunks if c.choices]
    calls = [call for d in deltas for call in d.delta.tool_calls or ()]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    arguments_of(calls[0], WEATHER)
    assert deltas[-1].finish_reason == "tool_calls"
    assert not any(d.delta.content for d in deltas)  # the call's JSON is not shown as content
    assert chunks[-1].usage.completion_tokens > 0


def test_tool_results_round_trip_and_hit_the_cache(client):
    first = chat(client, tools=[WEATHER], tool_choice="required").choices[0].message
    call = first.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    reply = chat(client, messages=history, tools=[WEATHER], max_tokens=40)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens_details.cached_tokens > 0  # the tools and question were cached


@pytest.mark.parametrize("kwargs, message", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
    ({"tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"extra_body": {"guided_json": {"type": "frobnicate"}}}, "cannot be compiled"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "one output constraint"),
    ({"extra_body": {"guided_whitespace_pattern": " "}}, "whitespace"),
    ({"extra_body": {"guided_decoding_backend": "outlines"}}, "guided_decoding_backend"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
])
def test_bad_constraints_and_tools_are_400(client, kwargs, message):
    with pytest.raises(openai.BadRequestError, match=message):
        chat(client, **kwargs)


def test_a_deeply_nested_schema_is_refused_quickly(client):
    schema = {"type": "integer"}
    for _ in range(300):
        schema = {"type": "array", "items": schema}
    with pytest.raises(openai.BadRequestError, match="nested more than"):
        chat(client, response_format={"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}})
    assert chat(client, max_tokens=2).choices[0].finish_reason == "length"  # the server goes on
