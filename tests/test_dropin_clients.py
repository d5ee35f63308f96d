"""The official clients that pagedrag stands in for, pointed at a pagedrag server, agree with
pagedrag's own classes given the same arguments: llama-index-llms-vllm's VllmServer (the
legacy /generate route), llama-index-llms-openai-like's OpenAILike and langchain-openai's
ChatOpenAI (the OpenAI routes). One engine (the article's vllm_kwargs, max_model_len 1024)
serves the in-process classes and the server, so answers compare token for token."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))  # the shared test support
from testing_support import VLLM_KWARGS  # noqa: E402

vllm_module = pytest.importorskip("llama_index.llms.vllm")
openai_like = pytest.importorskip("llama_index.llms.openai_like")
langchain_openai = pytest.importorskip("langchain_openai")
pagedrag_llamaindex = pytest.importorskip("llama_index.llms.pagedrag")
pagedrag_langchain = pytest.importorskip("langchain_pagedrag")

from langchain_core.messages import HumanMessage  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, MessageRole  # noqa: E402
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler  # noqa: E402

from pagedrag.client import DEFAULT_MODEL_NAME  # noqa: E402
from pagedrag.server.app import build_app  # noqa: E402
from pagedrag.server.background import BackgroundServer  # noqa: E402
from pagedrag.server.serving import ServerConfig  # noqa: E402

PagedRAG, ChatPagedRAG = pagedrag_llamaindex.PagedRAG, pagedrag_langchain.ChatPagedRAG
PROMPT = "The capital of France is"
MESSAGES = [ChatMessage(role=MessageRole.SYSTEM, content="You answer in one short sentence."),
            ChatMessage(role=MessageRole.USER, content="What is the capital of France?")]
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def vllm() -> PagedRAG:
    """The article's Vllm with only the import swapped, greedy."""
    return PagedRAG(model=None, vllm_kwargs=VLLM_KWARGS, temperature=0.0)


@pytest.fixture(scope="module")
def server(vllm) -> str:
    """A pagedrag server of that same engine on loopback."""
    app = build_app(vllm.client.shared.engine, ServerConfig(served_model_names=[DEFAULT_MODEL_NAME]))
    with BackgroundServer(app) as background:
        yield background.base_url


# ---- llama-index-llms-vllm's VllmServer -------------------------------------------------------
def test_vllmserver_and_pagedrag_agree_on_generate(server, vllm):
    arguments = {"api_url": f"{server}/generate", "max_new_tokens": 3, "top_k": 5, "stop": ["\n\n"],
                 "presence_penalty": 0.0, "frequency_penalty": 0.0, "ignore_eos": False}
    official = vllm_module.VllmServer(temperature=0.0, **arguments)
    ours = PagedRAG(temperature=0.0, **arguments)
    assert ours.base_url == server
    text = official.complete(PROMPT).text  # /generate answers with the prompt in front
    completion = ours.complete(PROMPT)
    assert text == PROMPT + completion.text == PROMPT + vllm.complete(PROMPT, max_new_tokens=3, top_k=5).text
    assert completion.raw["usage"]["completion_tokens"] <= 3
    assert "".join(piece.delta for piece in official.stream_complete(PROMPT)) == completion.text


def test_vllmserver_n_and_seed_reach_the_engine(server):
    official = vllm_module.VllmServer(api_url=f"{server}/generate", max_new_tokens=4, temperature=1.0, n=2)
    ours = PagedRAG(api_url=f"{server}/generate", max_new_tokens=4, temperature=1.0, n=2)
    choices = ours.complete(PROMPT, seed=5).raw["choices"]
    assert len(choices) == 2
    assert official.complete(PROMPT, seed=5).text == PROMPT + choices[0]["text"]


def test_pagedrag_through_the_server_reports_logprobs_as_in_process(server, vllm):
    remote = PagedRAG(api_url=f"{server}/generate", temperature=0.0)
    here, there = (llm.complete(PROMPT, max_new_tokens=3, logprobs=2) for llm in (vllm, remote))
    assert [[(p.token, round(p.logprob, 3)) for p in position] for position in here.logprobs] == \
           [[(p.token, round(p.logprob, 3)) for p in position] for position in there.logprobs]
    streamed = list(remote.stream_complete(PROMPT, max_new_tokens=3, logprobs=0))
    assert sum(len(piece.logprobs) for piece in streamed) == 3


# ---- llama-index-llms-openai-like's OpenAILike ----------------------------------------------
def test_openailike_and_pagedrag_agree(server, vllm):
    def openai_like_llm(is_chat_model: bool, **kwargs):
        return openai_like.OpenAILike(api_base=f"{server}/v1", api_key="EMPTY", model=DEFAULT_MODEL_NAME,
                                      is_chat_model=is_chat_model, context_window=VLLM_KWARGS["max_model_len"],
                                      max_tokens=3, temperature=0.0, **kwargs)

    official_counter, our_counter = (TokenCountingHandler(tokenizer=lambda text: []) for _ in range(2))
    official = openai_like_llm(True, callback_manager=CallbackManager([official_counter]))
    ours = PagedRAG(vllm_kwargs=VLLM_KWARGS, max_tokens=3, callback_manager=CallbackManager([our_counter]))
    assert official.metadata.context_window == ours.metadata.context_window
    theirs, mine = official.chat(MESSAGES), ours.chat(MESSAGES)
    assert theirs.message.content == mine.message.content
    assert theirs.raw.usage.prompt_tokens == mine.raw["usage"]["prompt_tokens"]
    counts = [[(e.prompt_token_count, e.completion_token_count) for e in c.llm_token_counts]
              for c in (official_counter, our_counter)]
    assert counts[0] == counts[1] == [(mine.raw["usage"]["prompt_tokens"], mine.raw["usage"]["completion_tokens"])]
    completions = openai_like_llm(False)
    assert completions.complete(PROMPT).text == ours.complete(PROMPT).text
    assert "".join(piece.delta for piece in completions.stream_complete(PROMPT)) == ours.complete(PROMPT).text


def test_openailike_sees_cached_tokens_as_pagedrag_reports_them(server, vllm):
    official = openai_like.OpenAILike(api_base=f"{server}/v1", api_key="EMPTY", model=DEFAULT_MODEL_NAME,
                                      is_chat_model=True, max_tokens=1, temperature=0.0)
    official.chat(MESSAGES)
    cached = official.chat(MESSAGES).raw.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached == vllm.chat(MESSAGES, max_tokens=1).raw["usage"]["prompt_tokens_details"][
        "cached_tokens"]


# ---- langchain-openai's ChatOpenAI -------------------------------------------------------------
OPENAI_ARGUMENTS = {"model": DEFAULT_MODEL_NAME, "temperature": 0.0, "max_completion_tokens": 3, "top_p": 0.9,
                    "presence_penalty": 0.1, "frequency_penalty": 0.1, "seed": 3, "stop_sequences": ["\n\n"],
                    "stream_usage": True, "timeout": 30.0, "max_retries": 1, "extra_body": {"top_k": 5}}


def test_chatopenai_and_chatpagedrag_agree(server):
    official = langchain_openai.ChatOpenAI(base_url=f"{server}/v1", api_key="EMPTY", **OPENAI_ARGUMENTS)
    remote = ChatPagedRAG(base_url=f"{server}/v1", api_key="EMPTY", **OPENAI_ARGUMENTS)
    local = ChatPagedRAG(engine_kwargs=VLLM_KWARGS, **OPENAI_ARGUMENTS)
    replies = [model.invoke(QUESTION) for model in (official, remote, local)]
    assert replies[0].content == replies[1].content == replies[2].content
    usages = [(r.usage_metadata["input_tokens"], r.usage_metadata["output_tokens"]) for r in replies]
    assert usages[0] == usages[1] == usages[2] and usages[0][1] <= 3
    for model in (official, remote, local):
        chunks = list(model.stream(QUESTION))
        whole = sum(chunks[1:], chunks[0])
        assert whole.content == replies[0].content and whole.usage_metadata["output_tokens"] == usages[0][1]


def test_chatopenai_n_and_logprobs_match(server):
    arguments = {**OPENAI_ARGUMENTS, "temperature": 1.0, "n": 2, "logprobs": True, "top_logprobs": 2}
    official = langchain_openai.ChatOpenAI(base_url=f"{server}/v1", api_key="EMPTY", **arguments)
    remote = ChatPagedRAG(base_url=server, **arguments)
    ours = ChatPagedRAG(engine_kwargs=VLLM_KWARGS, **arguments)
    theirs, there, mine = (model.generate([[HumanMessage(QUESTION)]]).generations[0]
                           for model in (official, remote, ours))
    assert [g.text for g in theirs] == [g.text for g in there] == [g.text for g in mine] and len(mine) == 2
    tokens = [[entry["token"] for entry in g.message.response_metadata["logprobs"]["content"]]
              for g in (theirs[0], there[0], mine[0])]
    assert tokens[0] == tokens[1] == tokens[2]
    tops = [len(entry["top_logprobs"]) for entry in mine[0].message.response_metadata["logprobs"]["content"]]
    assert set(tops) == {2}
