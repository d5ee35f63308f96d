"""PagedRAG as a LlamaIndex FunctionCallingLLM, in process on the embedded model: tool calls
(forced ones enforced by the engine's grammar), their round trip through messages and
memory, structured prediction, and the agents and query engines LlamaIndex builds on them."""

from __future__ import annotations

import json

import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.agent.workflow import AgentOutput, FunctionAgent, ReActAgent
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole, TextBlock, ToolCallBlock
from llama_index.core.base.response.schema import Response
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.memory import ChatMemoryBuffer
from llama_index.core.prompts import PromptTemplate
from llama_index.core.query_engine import RouterQueryEngine, SubQuestionQueryEngine
from llama_index.core.tools import FunctionTool, QueryEngineTool
from llama_index.llms.pagedrag import PagedRAG, StructuredQuestionGenerator
from llama_index.llms.pagedrag.messages import engine_messages
from pydantic import BaseModel, Field
from testing_support import ENGINE_KWARGS, MAX_TOKENS, rag_documents

QUESTION = "What is 2 plus 3?"
ALBUM_PROMPT = PromptTemplate("Generate an example album inspired by the movie {movie}.")


class Album(BaseModel):
    """A music album."""

    name: str = Field(max_length=40, description="The album's title")
    artist: str = Field(max_length=40)
    year: int


def add(a: int, b: int) -> int:
    """Add two integers and return their sum."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers and return their product."""
    return a * b


ADD, MULTIPLY = FunctionTool.from_defaults(fn=add), FunctionTool.from_defaults(fn=multiply)


@pytest.fixture(scope="module")
def llm() -> PagedRAG:
    """The embedded model, greedy, with room for a call or a short structured object."""
    return PagedRAG(engine_kwargs=ENGINE_KWARGS, max_tokens=64)


@pytest.fixture(scope="module")
def forced(llm) -> ChatResponse:
    """A reply that had to call one of the tools."""
    return llm.chat_with_tools([ADD, MULTIPLY], user_msg=QUESTION, tool_required=True)


@pytest.fixture
def recorded_add() -> tuple[FunctionTool, list]:
    """The add tool, recording the arguments of every call."""
    calls = []

    def add(a: int, b: int) -> int:
        """Add two integers and return their sum."""
        calls.append((a, b))
        return a + b

    return FunctionTool.from_defaults(fn=add), calls


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---- function calling ----------------------------------------------------------------------------
def test_pagedrag_is_a_function_calling_llm(llm):
    assert isinstance(llm, FunctionCallingLLM) and llm.metadata.is_function_calling_model
    texts = PagedRAG(engine_kwargs=ENGINE_KWARGS, messages_to_prompt=lambda messages: "Q:")
    assert not texts.metadata.is_function_calling_model  # a text prompt carries no tools


def test_a_forced_call_is_valid_against_the_tools_schema(llm, forced):
    [selection] = llm.get_tool_calls_from_response(forced)
    tool = {"add": ADD, "multiply": MULTIPLY}[selection.tool_name]
    tool.metadata.fn_schema.model_validate(selection.tool_kwargs)
    assert selection.tool_id.startswith("call_")
    assert forced.message.additional_kwargs["tool_calls"] == [
        tool_call(selection.tool_id, selection.tool_name, json.dumps(selection.tool_kwargs))]
    assert forced.message.content == "" and forced.additional_kwargs["finish_reason"] == "tool_calls"
    assert tool(**selection.tool_kwargs).raw_output == tool.fn(**selection.tool_kwargs)


def test_tool_choice_by_name_forces_that_tool(llm):
    response = llm.chat_with_tools([ADD, MULTIPLY], user_msg=QUESTION, tool_choice="multiply")
    [selection] = llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "multiply"
    MULTIPLY.metadata.fn_schema.model_validate(selection.tool_kwargs)


def calls_of(llm: PagedRAG, response: ChatResponse) -> list[tuple[str, dict]]:
    return [(s.tool_name, s.tool_kwargs) for s in llm.get_tool_calls_from_response(response)]


def test_a_stream_carries_the_call_on_its_last_piece(llm, forced):
    pieces = list(llm.stream_chat_with_tools([ADD, MULTIPLY], user_msg=QUESTION, tool_required=True))
    assert all("tool_calls" not in piece.message.additional_kwargs for piece in pieces[:-1])
    assert calls_of(llm, pieces[-1]) == calls_of(llm, forced)  # greedy: the same call


@pytest.mark.asyncio
async def test_async_forms_make_the_same_call(llm, forced):
    whole = await llm.achat_with_tools([ADD, MULTIPLY], user_msg=QUESTION, tool_required=True)
    pieces = [piece async for piece in await llm.astream_chat_with_tools([ADD, MULTIPLY], user_msg=QUESTION,
                                                                          tool_required=True)]
    assert calls_of(llm, whole) == calls_of(llm, pieces[-1]) == calls_of(llm, forced)


def test_no_call_is_a_clear_error(llm):
    prose = llm.chat_with_tools([ADD], user_msg=QUESTION, tool_choice="none", max_tokens=4)
    assert "tool_calls" not in prose.message.additional_kwargs
    with pytest.raises(ValueError, match="Expected at least one tool call.*Force a call with tool_required=True"):
        llm.get_tool_calls_from_response(prose)
    assert llm.get_tool_calls_from_response(prose, error_on_no_tool_call=False) == []
    cut = llm.chat_with_tools([ADD], user_msg=QUESTION, tool_required=True, max_tokens=3)
    assert cut.message.content.startswith("[")  # the call's JSON, cut short
    with pytest.raises(ValueError, match="finish_reason 'length'.*raise max_tokens"):
        llm.get_tool_calls_from_response(cut)


def test_prepare_chat_with_tools_builds_openai_specs(llm):
    history = [ChatMessage(role=MessageRole.SYSTEM, content="Be brief.")]
    prepared = llm._prepare_chat_with_tools([ADD], user_msg=QUESTION, chat_history=history, strict=True,
                                            max_tokens=5)
    assert [m.content for m in prepared.pop("messages")] == ["Be brief.", QUESTION] and len(history) == 1
    spec = ADD.metadata.to_openai_tool()
    spec["function"]["strict"] = True
    assert prepared == {"tools": [spec], "tool_choice": "auto", "parallel_tool_calls": False, "max_tokens": 5}
    choices = [llm._prepare_chat_with_tools([ADD], **kwargs)["tool_choice"] for kwargs in (
        {"tool_required": True}, {"tool_choice": "add"}, {"tool_choice": "none", "tool_required": True})]
    assert choices == ["required", {"type": "function", "function": {"name": "add"}}, "none"]
    assert llm._prepare_chat_with_tools([], user_msg=QUESTION, tool_required=True).keys() == {"messages"}


def test_only_the_first_call_is_kept_unless_parallel_calls_are_allowed(llm):
    calls = [tool_call("call_1", "add", '{"a": 1, "b": 2}'), tool_call("call_2", "add", '{"a": 3, "b": 4}')]

    def response() -> ChatResponse:
        return ChatResponse(message=ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": calls}))

    kept = llm._validate_chat_with_tools_response(response(), [ADD])
    assert [s.tool_id for s in llm.get_tool_calls_from_response(kept)] == ["call_1"]
    kept = llm._validate_chat_with_tools_response(response(), [ADD], allow_parallel_tool_calls=True)
    assert [s.tool_kwargs for s in llm.get_tool_calls_from_response(kept)] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]


# ---- messages --------------------------------------------------------------------------------------
def test_tool_calls_and_results_become_openai_messages():
    from openai.types.chat import ChatCompletionMessageToolCall

    call = tool_call("call_1", "add", '{"a": 2, "b": 3}')
    messages = [
        ChatMessage(role="user", content=QUESTION),
        ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [call]}),
        ChatMessage(role="tool", content="5", additional_kwargs={"tool_call_id": "call_1"}),
        ChatMessage(role="assistant", blocks=[TextBlock(text="Adding."),
                                              ToolCallBlock(tool_call_id="call_2", tool_name="add",
                                                            tool_kwargs={"a": 1, "b": 1})]),
        ChatMessage(role="assistant", content="", additional_kwargs={  # made by llama-index's OpenAI LLM
            "tool_calls": [ChatCompletionMessageToolCall.model_validate(call)]}),
        ChatMessage(role="assistant", content="5", additional_kwargs={"tool_call_id": "call_1"}),  # return_direct
    ]
    assert engine_messages(messages) == [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "5", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "Adding.", "tool_calls": [tool_call("call_2", "add", '{"a": 1, "b": 1}')]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "assistant", "content": "5"},
    ]
    with pytest.raises(TypeError, match=r"messages\[0\] \(user\) holds a ToolCallBlock"):
        engine_messages([ChatMessage(role="user", blocks=[ToolCallBlock(tool_name="add")])])


def test_a_tool_call_round_trip_reaches_an_answer(llm, forced):
    """The assistant's call and the tool's result are rendered into the prompt the model answers."""
    [selection] = llm.get_tool_calls_from_response(forced)
    result = {"add": ADD, "multiply": MULTIPLY}[selection.tool_name](**selection.tool_kwargs)
    history = [ChatMessage(role="user", content=QUESTION), forced.message,
               ChatMessage(role="tool", content=result.content, additional_kwargs={"tool_call_id": selection.tool_id})]
    answer = llm.chat(history, max_tokens=24)
    assert answer.message.content and "tool_calls" not in answer.message.additional_kwargs
    without_call = llm.chat([history[0], ChatMessage(role="assistant", content=""), history[2]], max_tokens=1)
    assert answer.additional_kwargs["prompt_tokens"] > without_call.additional_kwargs["prompt_tokens"]


# ---- structured outputs ----------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_structured_predict_returns_the_class(llm):
    album = llm.structured_predict(Album, ALBUM_PROMPT, movie="The Shining")
    assert isinstance(album, Album) and album.name
    assert await llm.astructured_predict(Album, ALBUM_PROMPT, movie="The Shining") == album


def test_stream_structured_predict_ends_with_the_object(llm):
    """The call is forced in a stream too; it arrives whole, so earlier partials are empty."""
    partials = list(llm.stream_structured_predict(Album, ALBUM_PROMPT, movie="The Shining"))
    assert isinstance(partials[-1], Album)
    assert partials[-1] == llm.structured_predict(Album, ALBUM_PROMPT, movie="The Shining")


def test_as_structured_llm_answers_with_the_object(llm):
    structured = llm.as_structured_llm(Album)
    response = structured.chat([ChatMessage(role="user", content="Generate an example album about the sea.")])
    assert isinstance(response.raw, Album) and Album.model_validate_json(response.message.content) == response.raw


def test_a_json_schema_constrains_a_plain_chat(llm):
    messages = [ChatMessage(role="user", content="Generate an example album about the sea as JSON.")]
    response = llm.chat(messages, structured_outputs={"json": Album})
    assert isinstance(Album.model_validate_json(response.message.content), Album)
    with pytest.raises(ValueError, match="cannot be combined"):  # a forced call is a grammar already
        llm.chat_with_tools([ADD], chat_history=messages, tool_required=True, structured_outputs={"json": Album})


# ---- agents ----------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_function_agent_calls_the_tool_and_answers(llm, recorded_add):
    tool, calls = recorded_add
    memory = ChatMemoryBuffer.from_defaults(llm=llm)
    agent = FunctionAgent(tools=[tool], llm=llm, initial_tool_choice="add")  # streams: astream_chat_with_tools
    output = await agent.run(QUESTION, memory=memory, max_iterations=4)
    assert isinstance(output, AgentOutput) and output.response.content
    [result] = output.tool_calls
    assert calls == [tuple(result.tool_kwargs.values())] and result.tool_output.raw_output == sum(calls[0])

    # the call and its result, as memory keeps them, go back to the engine as OpenAI messages
    sent = engine_messages(memory.get_all())
    [assistant] = [m for m in sent if "tool_calls" in m]
    [tool_result] = [m for m in sent if m["role"] == "tool"]
    assert assistant["tool_calls"][0]["id"] == tool_result["tool_call_id"] == result.tool_id


@pytest.mark.asyncio
async def test_react_agent_runs_to_completion(llm, recorded_add):
    """The 135M model does not write ReAct's Thought / Action format; LlamaIndex's parser takes
    such text as an implicit final answer, so the run completes, without a tool call."""
    tool, _ = recorded_add
    output = await ReActAgent(tools=[tool], llm=llm).run(QUESTION, max_iterations=4)
    assert isinstance(output, AgentOutput) and output.response.content


# ---- query engines -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def selector_llm() -> PagedRAG:
    """Room for LlamaIndex's selection and sub-question objects, whose free-text fields
    (a selection's reason) are unbounded; the same engine as ``llm``."""
    return PagedRAG(engine_kwargs=ENGINE_KWARGS, max_tokens=160)


@pytest.fixture(scope="module")
def answer_llm() -> PagedRAG:
    """What answers from the query engines' retrieved nodes: a few tokens (the tests below check
    which engine a question goes to, not the prose); the same engine as ``llm``."""
    return PagedRAG(engine_kwargs=ENGINE_KWARGS, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def query_engine_tools(embed_model, answer_llm) -> list[QueryEngineTool]:
    """Two small in-memory indexes: the json module's docstrings and the random module's."""
    documents = rag_documents()

    def engine(module: str):
        index = VectorStoreIndex.from_documents(
            [Document(text=d.text, id_=d.source_id) for d in documents if d.source_id.split(".")[0] == module],
            embed_model=embed_model)
        return index.as_query_engine(llm=answer_llm, similarity_top_k=2)

    return [QueryEngineTool.from_defaults(engine("json"), name="json_docs",
                                          description="Python's json module: encoding and decoding JSON."),
            QueryEngineTool.from_defaults(engine("random"), name="random_docs",
                                          description="Python's random module: random numbers and distributions.")]


def test_router_query_engine_selects_and_answers(selector_llm, query_engine_tools):
    router = RouterQueryEngine.from_defaults(query_engine_tools=query_engine_tools, llm=selector_llm)
    response = router.query("How do I parse a JSON document from a string?")
    assert isinstance(response, Response) and response.response
    [selection] = response.metadata["selector_result"].selections
    assert 0 <= selection.index < len(query_engine_tools)


def test_sub_question_query_engine_answers_through_the_tools(answer_llm, selector_llm, query_engine_tools):
    question_gen = StructuredQuestionGenerator(llm=selector_llm, max_questions=2, max_chars=80)
    engine = SubQuestionQueryEngine.from_defaults(query_engine_tools=query_engine_tools, llm=answer_llm,
                                                  question_gen=question_gen, verbose=False)
    response = engine.query("How do I parse JSON, and how do I seed the random number generator?")
    assert isinstance(response, Response) and response.response
    answered = [node.node.get_content() for node in response.source_nodes if "Sub question:" in node.node.get_content()]
    assert answered  # at least one sub-question ran against one of the tools
