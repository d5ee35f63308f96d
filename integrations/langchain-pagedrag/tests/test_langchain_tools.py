"""ChatPagedRAG's tool calling and structured output on the embedded model, in process:
every tool_choice form, calls in replies and streams, tool results sent back, and
with_structured_output for every schema kind and method. Schemas are bounded (maxLength,
ranges) so that the 135M model finishes within max_tokens; independent requests are
gathered, so the engine decodes them as one batch."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Literal

import jsonschema
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_pagedrag import ChatPagedRAG
from langchain_pagedrag._tool_calls import message_tool_calls, stream_tool_call_chunks
from langchain_pagedrag.chat_models import engine_messages
from pydantic import BaseModel, Field
from testing_support import ENGINE_KWARGS
from typing_extensions import TypedDict

from pagedrag.structured import StructuredOutputsParams
from pagedrag.tools import ToolCall

WEATHER_QUESTION = "What is the weather in Paris?"
PERSON_TEXT = "Alice is 31 years old and lives in Paris."


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(description="the city's name", max_length=20)


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Forecast(TypedDict):
    """Get the weather forecast of the coming days."""

    days: Annotated[int, ..., "how many days ahead"]


class CreateCustomer(BaseModel):
    """Create a customer."""

    customer_name: str = Field(description="the customer's name, in its own language", max_length=20)


SEARCH = {"title": "search", "description": "Search the web.", "type": "object",
          "properties": {"query": {"type": "string", "maxLength": 30}}, "required": ["query"]}
TOOLS = [GetWeather, add, Forecast, SEARCH]
PARAMETERS = {spec["function"]["name"]: spec["function"]["parameters"]
              for spec in map(convert_to_openai_tool, [*TOOLS, CreateCustomer])}
TOOL_NAMES = [spec["function"]["name"] for spec in map(convert_to_openai_tool, TOOLS)]
# (request, the name its call must hold) per forcing form, as langchain-tests' unicode test asks
CUSTOMERS = {"any": ("Create a customer named 'こんにちは株式会社' (Hello Corporation) - a Japanese company",
                     "こんにちは株式会社"),
             True: ("Create a customer named '你好啊集团' (Hello Group) - a Chinese technology company", "你好啊集团")}


class Person(BaseModel):
    """A person the text mentions."""

    name: str = Field(description="the person's name", max_length=24)
    age: int = Field(description="the person's age in years", ge=0, le=150)


class PersonDict(TypedDict):
    """A person the text mentions."""

    name: Annotated[str, ..., "the person's name"]
    age: Annotated[int, ..., "the person's age in years"]


PERSON_SCHEMA = {"title": "Person", "description": "A person the text mentions.", "type": "object",
                 "properties": {"name": {"type": "string", "maxLength": 24},
                                "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                 "required": ["name", "age"]}
SCHEMAS = {"pydantic": Person, "typeddict": PersonDict, "json_schema": PERSON_SCHEMA}
METHODS = ("json_schema", "function_calling", "json_mode")
JSON_MODE_TEXT = f"{PERSON_TEXT} Reply with a JSON object with the keys name and age."


class GradeDocuments(BaseModel):
    """Binary score for relevance check on retrieved documents."""

    binary_score: Literal["yes", "no"] = Field(description="Documents are relevant to the question, 'yes' or 'no'")


@pytest.fixture(scope="module")
def chat() -> ChatPagedRAG:
    return ChatPagedRAG(engine_kwargs=ENGINE_KWARGS, temperature=0, max_tokens=48)


def assert_valid_calls(message: AIMessage, names: set[str]) -> None:
    """At least one call, each of a tool in ``names``, its arguments valid for that tool's schema."""
    assert message.tool_calls and not message.invalid_tool_calls
    assert message.response_metadata["finish_reason"] == "tool_calls"
    for call in message.tool_calls:
        assert call["name"] in names and call["id"].startswith("call_"), call
        jsonschema.validate(call["args"], PARAMETERS[call["name"]])


# ---- bind_tools ---------------------------------------------------------------------------
@pytest.mark.parametrize(("tool_choice", "names"), [
    ("any", TOOL_NAMES), ("required", TOOL_NAMES), (True, TOOL_NAMES), *((name, [name]) for name in TOOL_NAMES),
    ({"type": "function", "function": {"name": "add"}}, ["add"])])
def test_every_forcing_tool_choice_form_gets_a_valid_call(chat, tool_choice, names):
    """"any", "required" and True force a call of some bound tool; a name (of each kind of
    tool) or OpenAI's dict force that one. (Run one by one, the requests share the
    tools' prompt through the prefix cache.)"""
    reply = chat.bind_tools(TOOLS, tool_choice=tool_choice).invoke(WEATHER_QUESTION)
    assert_valid_calls(reply, set(names))


def test_parallel_tool_calls_false_makes_one_call(chat):
    reply = chat.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False).invoke(WEATHER_QUESTION)
    assert_valid_calls(reply, set(TOOL_NAMES))
    assert len(reply.tool_calls) == 1


def test_any_with_one_tool_is_exactly_one_call_of_it(chat):
    """(Unless parallel calls are asked for.) Its arguments keep non-ASCII text as it is, in
    the reply and on the way back."""
    assert chat.bind_tools([CreateCustomer], tool_choice="any").kwargs["parallel_tool_calls"] is False
    assert chat.bind_tools([CreateCustomer], tool_choice=True, parallel_tool_calls=True).kwargs["parallel_tool_calls"]
    for choice, (request, name) in CUSTOMERS.items():
        reply = chat.bind_tools([CreateCustomer], tool_choice=choice).invoke(request)
        assert_valid_calls(reply, {"CreateCustomer"})
        assert len(reply.tool_calls) == 1 and reply.tool_calls[0]["args"]["customer_name"] == name
        assert name in engine_messages([reply])[0]["tool_calls"][0]["function"]["arguments"]


def test_tool_choice_none_and_auto_leave_the_reply_free(chat):
    for choice in ("none", "auto", None):
        reply = chat.bind_tools(TOOLS, tool_choice=choice).invoke(WEATHER_QUESTION, max_tokens=4)
        assert reply.content and not reply.tool_calls  # (the 135M model answers in prose)
        assert reply.response_metadata["finish_reason"] in ("stop", "length")


def test_bad_tool_choices_are_refused(chat):
    with pytest.raises(ValueError, match="neither a bound tool .*GetWeather, add, Forecast, search"):
        chat.bind_tools(TOOLS, tool_choice="get_weather")
    with pytest.raises(TypeError, match="tool_choice must be"):
        chat.bind_tools(TOOLS, tool_choice=1)
    with pytest.raises(ValueError, match="not among the tools"):
        chat.bind_tools(TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}).invoke("Hi")
    with pytest.raises(ValueError, match="cannot be combined with response_format"):
        chat.bind_tools(TOOLS, tool_choice="any").invoke("Hi", response_format={"type": "json_object"})


def test_a_streamed_call_adds_up_to_the_invoked_one(chat):
    """The calls come whole on the last chunk; summed, the chunks read as invoke's reply."""
    forced = chat.bind_tools([add], tool_choice="add")
    reply = forced.invoke("What is 2 plus 3?")
    chunks = list(forced.stream("What is 2 plus 3?"))
    assert not any(chunk.tool_call_chunks for chunk in chunks[:-1])
    total = sum(chunks[1:], chunks[0])
    assert isinstance(total, AIMessageChunk) and total.response_metadata["finish_reason"] == "tool_calls"
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [(c["name"], c["args"]) for c in reply.tool_calls]
    assert [c["id"] for c in total.tool_calls] == [c["id"] for c in chunks[-1].tool_call_chunks]


def test_calls_become_tool_calls_chunks_and_invalid_calls():
    """A reply keeps calls whose arguments are not an object's JSON as invalid_tool_calls;
    stream chunks carry every call whole, indexed in order (summed, LangChain reads their
    arguments as partial JSON: "{oops" is {} there, a list stays invalid)."""
    calls = (ToolCall("call_a", "add", '{"a": 1, "b": 2}'), ToolCall("call_b", "add", "{oops"),
             ToolCall("call_c", "add", "[1, 2]"))
    fields = message_tool_calls(calls)
    assert fields["tool_calls"] == [{"name": "add", "args": {"a": 1, "b": 2}, "id": "call_a", "type": "tool_call"}]
    assert [(c["id"], c["args"]) for c in fields["invalid_tool_calls"]] == [("call_b", "{oops"), ("call_c", "[1, 2]")]
    chunks = stream_tool_call_chunks(calls)
    assert [(chunk["id"], chunk["args"], chunk["index"]) for chunk in chunks] == [
        (call.id, call.arguments, index) for index, call in enumerate(calls)]
    streamed = AIMessageChunk(content="") + AIMessageChunk(content="", tool_call_chunks=chunks)
    assert [c["id"] for c in streamed.tool_calls] == ["call_a", "call_b"]
    assert [c["id"] for c in streamed.invalid_tool_calls] == ["call_c"]


# ---- tool results back to the model -------------------------------------------------------
def test_a_tool_result_goes_back_and_the_model_answers(chat):
    question = HumanMessage("What is 2 plus 3?")
    call_message = chat.bind_tools([add], tool_choice="add").invoke([question])
    result = add.invoke(call_message.tool_calls[0])
    assert isinstance(result, ToolMessage)
    conversation = [question, call_message, result]
    sent = engine_messages(conversation)
    call = call_message.tool_calls[0]
    assert sent[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": "add", "arguments": json.dumps(call["args"])}}]}
    assert sent[2] == {"role": "tool", "tool_call_id": call["id"], "content": result.content}
    answer = chat.bind_tools([add]).invoke(conversation, max_tokens=16)
    assert answer.content and not answer.tool_calls


def test_conversions_of_calls_sent_back():
    """Blocks restating the message's own calls (Anthropic's tool_use, LangChain v1's
    tool_call) are left to tool_calls; other non-text blocks are refused; invalid calls
    go as they came; a summed stream (AIMessageChunk) is an assistant message."""
    call = {"name": "add", "args": {"a": 1, "b": 2}, "id": "call_1", "type": "tool_call"}
    restating = AIMessage(content=[{"type": "text", "text": "Adding."},
                                   {"type": "tool_use", "id": "call_1", "name": "add", "input": call["args"]}],
                          tool_calls=[call])
    assert engine_messages([restating])[0]["content"] == "Adding."
    other = AIMessage(content=[{"type": "tool_use", "id": "call_2", "name": "add", "input": {}}], tool_calls=[call])
    with pytest.raises(TypeError, match="'tool_use' block"):
        engine_messages([other])
    invalid = AIMessage(content="", invalid_tool_calls=[{"name": "add", "args": "{oops", "id": "call_3",
                                                         "error": None, "type": "invalid_tool_call"}])
    assert engine_messages([invalid])[0]["tool_calls"][0]["function"]["arguments"] == "{oops"
    assert engine_messages([AIMessageChunk(content="Hi")]) == [{"role": "assistant", "content": "Hi"}]
    tool_blocks = ToolMessage(content=[{"type": "text", "text": "3"}], tool_call_id="call_1")
    assert engine_messages([tool_blocks]) == [{"role": "tool", "content": "3", "tool_call_id": "call_1"}]


# ---- structured output ----------------------------------------------------------------------
def check_person(parsed, schema) -> None:
    """``parsed`` has the schema's type (a pydantic instance, else a dict) and is valid for it."""
    if schema is Person:
        assert isinstance(parsed, Person)
    else:
        assert isinstance(parsed, dict)
        jsonschema.validate(parsed, PERSON_SCHEMA)


@pytest.mark.asyncio
async def test_every_schema_kind_and_method_with_raw(chat):
    """Each (schema kind, method) pair, gathered: include_raw gives the message, the parsed
    value and no error."""
    cases = [(kind, method) for kind in SCHEMAS for method in METHODS]
    results = await asyncio.gather(*(
        chat.with_structured_output(SCHEMAS[kind], method=method, include_raw=True).ainvoke(
            JSON_MODE_TEXT if method == "json_mode" else PERSON_TEXT) for kind, method in cases))
    for (kind, method), result in zip(cases, results):
        assert set(result) == {"raw", "parsed", "parsing_error"} and result["parsing_error"] is None, (kind, method)
        assert isinstance(result["raw"], AIMessage)
        assert bool(result["raw"].tool_calls) == (method == "function_calling")
        check_person(result["parsed"], SCHEMAS[kind])


@pytest.mark.parametrize(("kind", "method"), [("pydantic", "json_schema"), ("typeddict", "function_calling"),
                                              ("json_schema", "json_mode")])
def test_structured_output_invoke_and_stream(chat, kind, method):
    structured = chat.with_structured_output(SCHEMAS[kind], method=method)
    text = JSON_MODE_TEXT if method == "json_mode" else PERSON_TEXT
    check_person(structured.invoke(text), SCHEMAS[kind])
    streamed = list(structured.stream(text))
    check_person(streamed[-1], SCHEMAS[kind])


def test_a_reply_that_does_not_parse_is_a_parsing_error_with_raw(chat):
    cut_short = chat.with_structured_output(Person, include_raw=True, max_tokens=3).invoke(PERSON_TEXT)
    assert cut_short["parsed"] is None and cut_short["parsing_error"] is not None
    assert cut_short["raw"].response_metadata["finish_reason"] == "length"


def test_structured_output_arguments_are_checked(chat):
    with pytest.raises(ValueError, match="method must be one of"):
        chat.with_structured_output(Person, method="tools")
    with pytest.raises(ValueError, match="strict does not apply"):
        chat.with_structured_output(Person, method="json_mode", strict=True)
    with pytest.raises(ValueError, match="needs a schema"):
        chat.with_structured_output(None)


def test_grade_documents_as_in_agentic_rag(chat):
    """LangGraph's agentic-RAG grader: a prompt, then the model bound to GradeDocuments,
    over a batch of (document, question) pairs; every grade is "yes" or "no"."""
    prompt = ChatPromptTemplate.from_messages([
        ("system", "You grade whether a retrieved document is relevant to a user question. Answer 'yes' or 'no'."),
        ("human", "Document: {document}\n\nQuestion: {question}")])
    grader = prompt | chat.with_structured_output(GradeDocuments)
    pairs = [{"document": "json.dumps serializes an object to a JSON formatted str.",
              "question": "How do I convert a Python object to a JSON string?"},
             {"document": "random.seed initializes the random number generator.",
              "question": "How do I convert a Python object to a JSON string?"}]
    grades = grader.batch(pairs)
    assert all(isinstance(grade, GradeDocuments) and grade.binary_score in ("yes", "no") for grade in grades)


# ---- response_format and structured_outputs per call -------------------------------------------
def test_response_format_becomes_structured_outputs(chat):
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    as_schema = chat.call_sampling({"response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": schema}}}, None)
    assert as_schema.structured_outputs == StructuredOutputsParams(json=schema)
    assert chat.call_sampling({"response_format": {"type": "json_object"}}, None).structured_outputs == \
        StructuredOutputsParams(json_object=True)
    assert chat.call_sampling({"response_format": {"type": "text"}}, None).structured_outputs is None
    assert chat.call_sampling({"structured_outputs": {"regex": "[ab]"}}, None).structured_outputs == \
        StructuredOutputsParams(regex="[ab]")
    with pytest.raises(ValueError, match="response_format and structured_outputs both"):
        chat.call_sampling({"response_format": {"type": "json_object"}, "structured_outputs": {"json": schema}}, None)
    with pytest.raises(TypeError, match="response_format must be an object"):
        chat.call_sampling({"response_format": "json_object"}, None)
