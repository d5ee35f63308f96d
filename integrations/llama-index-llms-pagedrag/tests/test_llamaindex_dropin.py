"""PagedRAG as a drop-in for llama-index-llms-vllm's Vllm / VllmServer, in process: every
constructor argument of theirs kept with its meaning, per-call aliases, n, logprobs, the
usage that TokenCountingHandler reads, and what is refused. (The official VllmServer
against a pagedrag serve: tests/test_dropin_clients.py.)"""

from __future__ import annotations

import logging

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.llms.pagedrag import PagedRAG
from pydantic import ValidationError
from testing_support import VLLM_KWARGS

from pagedrag.sampling_params import SamplingParams

PROMPT = "The capital of France is"
MESSAGES = [ChatMessage(role=MessageRole.USER, content="What is the capital of France?")]
# One value for every constructor argument of Vllm and VllmServer (llama-index-llms-vllm 0.8)
VLLM_ARGUMENTS = {
    "model": None, "temperature": 0.5, "tensor_parallel_size": 1, "trust_remote_code": False, "n": 2,
    "best_of": 2, "presence_penalty": 0.5, "frequency_penalty": 0.25, "top_p": 0.9, "top_k": 5,
    "stop": ["\n\n"], "ignore_eos": True, "max_new_tokens": 3, "logprobs": 2, "dtype": "float32",
    "download_dir": "/tmp/pagedrag-downloads", "vllm_kwargs": VLLM_KWARGS, "api_url": "",
    "callback_manager": CallbackManager([]), "system_prompt": "Be brief.", "messages_to_prompt": None,
    "completion_to_prompt": None, "output_parser": None, "pydantic_program_mode": "default",
    "is_chat_model": False, "openai_like": False,
    "api_headers": {}, "timeout": 30.0,
}


@pytest.fixture
def vllm() -> PagedRAG:
    """The article's LLM with only the import swapped (the embedded model; max_model_len 1024)."""
    return PagedRAG(model=None, vllm_kwargs=VLLM_KWARGS, temperature=0.0)


def test_the_articles_snippet_runs_and_follows_max_model_len(vllm):
    assert vllm.engine_kwargs == VLLM_KWARGS and vllm.base_url is None
    assert vllm.metadata.context_window == VLLM_KWARGS["max_model_len"] == vllm.stats()["max_model_len"]
    assert vllm.complete(PROMPT).text
    assert PagedRAG(vllm_kwargs=VLLM_KWARGS, context_window=512).metadata.context_window == 512


def test_every_vllm_and_vllmserver_argument_is_accepted_and_kept():
    vllm = pytest.importorskip("llama_index.llms.vllm")
    fields = set(vllm.Vllm.model_fields) | set(vllm.VllmServer.model_fields)
    assert fields - {"query_wrapper_prompt", "rate_limiter"} == set(VLLM_ARGUMENTS)  # LLM's own, not theirs
    llm = PagedRAG(**VLLM_ARGUMENTS)
    assert llm.engine_kwargs == {**VLLM_KWARGS, "tensor_parallel_size": 1, "trust_remote_code": False,
                                 "dtype": "float32", "download_dir": "/tmp/pagedrag-downloads"}
    assert (llm.base_url, llm.timeout, llm.is_chat_model, llm.system_prompt) == (None, 30.0, False, "Be brief.")
    assert llm.sampling({}) == SamplingParams(temperature=0.5, n=2, presence_penalty=0.5, frequency_penalty=0.25,
                                              top_p=0.9, top_k=5, stop=["\n\n"], ignore_eos=True, max_tokens=3,
                                              logprobs=2)


def test_max_new_tokens_is_kept_in_the_constructor_and_per_call(vllm):
    short = PagedRAG(vllm_kwargs=VLLM_KWARGS, max_new_tokens=3, ignore_eos=True)
    assert short.complete(PROMPT).additional_kwargs["completion_tokens"] == 3
    assert vllm.complete(PROMPT, max_new_tokens=2).additional_kwargs["completion_tokens"] <= 2
    assert vllm.chat(MESSAGES, max_new_tokens=1).raw["usage"]["completion_tokens"] == 1


def test_n_2_gives_every_choice_in_raw(vllm):
    response = vllm.complete(PROMPT, n=2, max_new_tokens=3, temperature=1.0, seed=7)
    choices = response.raw["choices"]
    assert [choice["index"] for choice in choices] == [0, 1] and response.text == choices[0]["text"]
    assert response.raw["usage"]["completion_tokens"] <= 6
    with pytest.raises(ValueError, match="n must be 1"):
        list(vllm.stream_complete(PROMPT, n=2))


def test_raw_usage_is_what_token_counting_handler_reads(vllm):
    counter = TokenCountingHandler(tokenizer=lambda text: [])  # its own estimates would all be 0
    llm = PagedRAG(vllm_kwargs=VLLM_KWARGS, max_new_tokens=4, callback_manager=CallbackManager([counter]))
    usage = llm.complete(PROMPT).raw["usage"]
    chat_usage = llm.chat(MESSAGES).raw["usage"]
    streamed = list(llm.stream_complete(PROMPT))[-1].raw["usage"]
    assert usage["prompt_tokens"] == len(llm.client.shared.tokenizer.encode(PROMPT))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert [(e.prompt_token_count, e.completion_token_count) for e in counter.llm_token_counts] == [
        (u["prompt_tokens"], u["completion_tokens"]) for u in (usage, chat_usage, streamed)]


def test_cached_tokens_are_openais_prompt_tokens_details(vllm):
    vllm.chat(MESSAGES)
    again = vllm.chat(MESSAGES)
    assert again.raw["usage"]["prompt_tokens_details"]["cached_tokens"] == again.additional_kwargs["cached_tokens"] > 0


def test_logprobs_fill_the_response(vllm):
    response = vllm.complete(PROMPT, max_new_tokens=3, logprobs=2)
    assert len(response.logprobs) == 3 and all(len(position) == 2 for position in response.logprobs)
    assert response.logprobs[0][0].token == response.text[:len(response.logprobs[0][0].token)]  # greedy: the best
    pieces = list(vllm.stream_complete(PROMPT, max_new_tokens=3, logprobs=0))
    assert sum(len(piece.logprobs) for piece in pieces) == 3


def test_messages_to_prompt_and_completion_to_prompt_are_used(vllm):
    tokenizer = vllm.client.shared.tokenizer
    llm = PagedRAG(vllm_kwargs=VLLM_KWARGS, max_new_tokens=1, messages_to_prompt=lambda messages: "Q: France?\nA:",
                   completion_to_prompt=lambda text: f"Q: {text}\nA:")
    assert llm.chat(MESSAGES).raw["prompt_tokens"] == len(tokenizer.encode("Q: France?\nA:"))
    assert llm.complete("France?").raw["prompt_tokens"] == len(tokenizer.encode("Q: France?\nA:"))


def test_what_pagedrag_cannot_honour_is_refused(vllm):
    with pytest.raises(ValidationError, match="max_new_token"):  # a misspelt argument
        PagedRAG(max_new_token=3)
    with pytest.raises(TypeError, match=r"\['enable_lora', 'max_loras'\]"):
        PagedRAG(vllm_kwargs={"enable_lora": True, "max_loras": 2})
    with pytest.raises(ValidationError, match="best_of=4 is not supported"):
        PagedRAG(best_of=4)
    with pytest.raises(ValidationError, match="tensor_parallel_size must be a positive integer"):
        PagedRAG(tensor_parallel_size=0)
    with pytest.raises(ValidationError, match="max_tokens=8 and max_new_tokens=3"):
        PagedRAG(max_tokens=8, max_new_tokens=3)
    with pytest.raises(ValidationError, match="configure an in-process engine"):
        PagedRAG(api_url="http://127.0.0.1:9/generate", vllm_kwargs={"max_model_len": 1024})
    with pytest.raises(ValidationError, match=r"additional_kwargs sets \['top_k'\]"):
        PagedRAG(top_k=3, additional_kwargs={"top_k": 4})
    assert PagedRAG(additional_kwargs={"top_k": 4}).sampling({}).top_k == 4  # over the default: no clash
    with pytest.raises(TypeError, match=r"\['beam_width'\]"):
        vllm.complete(PROMPT, beam_width=2)
    with pytest.raises(ValueError, match="prompt_logprobs"):  # computed, then nowhere to report it
        vllm.complete(PROMPT, prompt_logprobs=1)


def test_openai_like_is_a_logged_warning(caplog):
    with caplog.at_level(logging.WARNING):
        PagedRAG(vllm_kwargs=VLLM_KWARGS, openai_like=True)
    assert "ignores openai_like=True" in caplog.text


def test_api_url_names_the_server():
    assert PagedRAG(api_url="http://127.0.0.1:8000/generate").base_url == "http://127.0.0.1:8000"
    assert PagedRAG(api_url="http://127.0.0.1:8000/v1/chat/completions/").base_url == "http://127.0.0.1:8000"
    assert PagedRAG(api_url="http://127.0.0.1:8000", api_headers={"X-Team": "a"}).default_headers == {"X-Team": "a"}


def test_vllmserver_default_trust_remote_code_is_ignored_with_a_warning(caplog):
    """VllmServer's own default (trust_remote_code=True, which it never uses) is accepted for
    a server, with a warning; other engine arguments are still refused."""
    with caplog.at_level(logging.WARNING, logger="pagedrag"):
        llm = PagedRAG(api_url="http://127.0.0.1:9/generate", trust_remote_code=True)
    assert llm.engine_kwargs == {} and "trust_remote_code=True not used" in caplog.text
    with pytest.raises(ValidationError, match="configure an in-process engine"):
        PagedRAG(api_url="http://127.0.0.1:9/generate", trust_remote_code=True, vllm_kwargs={"max_model_len": 1024})


def test_a_saved_llm_loads_without_a_connection_warning(caplog):
    """to_dict spells timeout and max_retries out at their defaults: not a user's settings;
    a value of one's own is still warned about in process."""
    with caplog.at_level(logging.WARNING, logger="pagedrag"):
        PagedRAG.from_dict(PagedRAG(vllm_kwargs=VLLM_KWARGS).to_dict())
    assert "not used" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="pagedrag"):
        PagedRAG(vllm_kwargs=VLLM_KWARGS, max_retries=5)
    assert "max_retries not used" in caplog.text
