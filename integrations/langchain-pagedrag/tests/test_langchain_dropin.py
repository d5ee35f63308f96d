"""ChatPagedRAG and PagedRAGLLM as drop-ins for ChatOpenAI (and ChatOllama where the names
map), in process: every argument kept with its meaning, unknown ones routed as ChatOpenAI
routes them, n, logprobs, stream_usage, serialization, and what is refused. (The official
ChatOpenAI against a pagedrag serve: tests/test_dropin_clients.py.)"""

from __future__ import annotations

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.load import dumpd, load
from langchain_core.messages import HumanMessage
from langchain_core.utils.utils import get_pydantic_field_names
from langchain_pagedrag import ChatPagedRAG, PagedRAGLLM
from pydantic import SecretStr, ValidationError
from testing_support import VLLM_KWARGS

from pagedrag.sampling_params import SamplingParams

QUESTION = "What is the capital of France?"
# ChatOpenAI's names (fields or aliases) that ChatPagedRAG keeps, with a value each
OPENAI_ARGUMENTS = {
    "model": None, "temperature": 0.5, "max_completion_tokens": 3, "top_p": 0.9, "n": 2,
    "presence_penalty": 0.5, "frequency_penalty": 0.25, "seed": 11, "logprobs": True, "top_logprobs": 2,
    "stop_sequences": ["\n\n"], "streaming": False, "stream_usage": False, "timeout": 30.0, "max_retries": 1,
    "base_url": None, "api_key": "sk-local", "model_kwargs": {"min_p": 0.05}, "extra_body": {"ignore_eos": True},
}
OLLAMA_ARGUMENTS = {"num_predict": 3, "num_ctx": VLLM_KWARGS["max_model_len"], "top_k": 5, "repeat_penalty": 1.2}


@pytest.fixture
def chat() -> ChatPagedRAG:
    return ChatPagedRAG(engine_kwargs=VLLM_KWARGS)


def test_chatopenai_arguments_are_kept():
    openai = pytest.importorskip("langchain_openai")
    assert set(OPENAI_ARGUMENTS) <= get_pydantic_field_names(openai.ChatOpenAI)
    chat = ChatPagedRAG(engine_kwargs=VLLM_KWARGS, **OPENAI_ARGUMENTS)
    assert (chat.max_tokens, chat.stop, chat.timeout, chat.max_retries) == (3, ["\n\n"], 30.0, 1)
    assert chat.api_key == SecretStr("sk-local") and not chat.stream_usage
    assert chat.sampling({}) == SamplingParams(temperature=0.5, max_tokens=3, top_p=0.9, n=2, presence_penalty=0.5,
                                               frequency_penalty=0.25, seed=11, logprobs=2, stop=["\n\n"],
                                               min_p=0.05, ignore_eos=True)


def test_chatollama_arguments_map():
    chat = ChatPagedRAG(engine_kwargs={"kv_cache_memory_bytes": 1 << 28}, **OLLAMA_ARGUMENTS)
    assert chat.engine_kwargs == {"kv_cache_memory_bytes": 1 << 28, "max_model_len": VLLM_KWARGS["max_model_len"]}
    assert chat.sampling({}) == SamplingParams(temperature=0.0, max_tokens=3, top_k=5, repetition_penalty=1.2)


def test_max_completion_tokens_per_call_and_n(chat):
    assert chat.invoke(QUESTION, max_completion_tokens=2).usage_metadata["output_tokens"] <= 2
    assert chat.invoke(QUESTION, num_predict=1).usage_metadata["output_tokens"] == 1
    result = ChatPagedRAG(engine_kwargs=VLLM_KWARGS, n=2, max_tokens=3, temperature=1.0, seed=3).generate(
        [[HumanMessage(QUESTION)]])
    assert len(result.generations[0]) == 2
    assert result.generations[0][0].message.usage_metadata["output_tokens"] <= 6
    completions = PagedRAGLLM(engine_kwargs=VLLM_KWARGS, n=2, max_tokens=3).generate(["One, two,"])
    assert len(completions.generations[0]) == 2 and completions.llm_output["token_usage"]["completion_tokens"] <= 6


def test_unknown_arguments_move_to_model_kwargs_with_a_warning():
    with pytest.warns(UserWarning, match="min_tokens was transferred to model_kwargs"):
        chat = ChatPagedRAG(engine_kwargs=VLLM_KWARGS, min_tokens=2)
    assert chat.model_kwargs == {"min_tokens": 2} and chat.sampling({}).min_tokens == 2
    with pytest.warns(UserWarning), pytest.raises(TypeError, match=r"\['service_tier'\]"):
        ChatPagedRAG(engine_kwargs=VLLM_KWARGS, service_tier="flex")  # not a SamplingParams field


def test_extra_body_reaches_the_engine(chat):
    token_id = chat.client.shared.tokenizer.encode(" Paris")[0]
    only = ChatPagedRAG(engine_kwargs=VLLM_KWARGS, max_tokens=3, extra_body={"allowed_token_ids": [token_id]})
    reply = only.invoke(QUESTION)
    assert reply.content == " Paris" * 3 and reply.response_metadata["finish_reason"] == "length"


def test_stream_usage_is_honoured(chat):
    with_usage = list(chat.stream(QUESTION, max_tokens=3))
    without = list(ChatPagedRAG(engine_kwargs=VLLM_KWARGS, stream_usage=False).stream(QUESTION, max_tokens=3))
    assert sum(with_usage[1:], with_usage[0]).usage_metadata["output_tokens"] == 3
    assert sum(without[1:], without[0]).usage_metadata is None
    per_call = list(chat.stream(QUESTION, max_tokens=3, stream_usage=False))
    assert sum(per_call[1:], per_call[0]).usage_metadata is None


def test_logprobs_as_chatopenai_reports_them(chat):
    reply = chat.invoke(QUESTION, max_tokens=3, logprobs=True, top_logprobs=2)
    content = reply.response_metadata["logprobs"]["content"]
    assert len(content) == 3 and all(len(entry["top_logprobs"]) == 2 for entry in content)
    assert "".join(entry["token"] for entry in content) == reply.content
    chunks = list(chat.stream(QUESTION, max_tokens=3, logprobs=True))
    assert len(sum(chunks[1:], chunks[0]).response_metadata["logprobs"]["content"]) == 3


def test_streaming_completion_model_reports_each_token():
    tokens = []

    class Recorder(BaseCallbackHandler):
        def on_llm_new_token(self, token, **kwargs):
            tokens.append(token)

    llm = PagedRAGLLM(engine_kwargs=VLLM_KWARGS, max_tokens=4, streaming=True, callbacks=[Recorder()])
    text = llm.invoke("One, two,")
    assert "".join(tokens) == text and len(tokens) >= 2


def test_serializable_with_the_key_as_a_secret(monkeypatch):
    chat = ChatPagedRAG(engine_kwargs=VLLM_KWARGS, api_key="sk-local", max_completion_tokens=3)
    dumped = dumpd(chat)
    assert dumped["kwargs"]["api_key"] == {"lc": 1, "type": "secret", "id": ["PAGEDRAG_API_KEY"]}
    assert "sk-local" not in str(dumped)
    monkeypatch.setenv("PAGEDRAG_API_KEY", "sk-local")
    loaded = load(dumped, valid_namespaces=["langchain_pagedrag"], allowed_objects=[ChatPagedRAG],
                  secrets_from_env=True)
    assert loaded.api_key == SecretStr("sk-local") and loaded.max_tokens == 3 and loaded.engine_kwargs == VLLM_KWARGS


def test_what_pagedrag_cannot_honour_is_refused(chat):
    with pytest.raises(ValidationError, match="n must be 1 when streaming"):
        ChatPagedRAG(streaming=True, n=2)
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs=True"):
        ChatPagedRAG(top_logprobs=2)
    with pytest.raises(TypeError, match=r"extra_body keys \['guided_json'\]"):
        ChatPagedRAG(extra_body={"guided_json": {}})
    with pytest.raises(ValidationError, match="both model_kwargs and extra_body"):
        ChatPagedRAG(model_kwargs={"min_p": 0.1}, extra_body={"min_p": 0.2})
    with pytest.raises(ValidationError, match="configure an in-process engine"):
        ChatPagedRAG(base_url="http://127.0.0.1:9", num_ctx=512)
    with pytest.raises(TypeError, match=r"\['functions'\]"):  # ChatOpenAI's deprecated keyword: use tools
        chat.invoke(QUESTION, functions=[])
    with pytest.raises(ValueError, match="n must be 1"):
        list(chat.stream(QUESTION, n=2))


def test_connection_settings_in_process_are_a_logged_warning(caplog):
    with caplog.at_level("WARNING", logger="pagedrag"):
        ChatPagedRAG(engine_kwargs=VLLM_KWARGS, api_key="sk-x", timeout=30.0, max_retries=1)
    assert "api_key, timeout, max_retries not used" in caplog.text


def test_completion_model_logprobs_count_alternatives_as_vllm():
    """PagedRAGLLM's logprobs is VLLM's / OpenAI's int (in the constructor and per call);
    ChatPagedRAG keeps ChatOpenAI's bool with top_logprobs."""
    def alternatives(llm, **call):
        info = llm.generate(["Hi"], **call).generations[0][0].generation_info
        return [len(entry["top_logprobs"]) for entry in info["logprobs"]["content"]]

    assert alternatives(PagedRAGLLM(engine_kwargs=VLLM_KWARGS, max_tokens=2, logprobs=1)) == [1, 1]
    assert alternatives(PagedRAGLLM(engine_kwargs=VLLM_KWARGS, max_tokens=2), logprobs=3) == [3, 3]
    assert PagedRAGLLM(logprobs=0).sampling_logprobs(0, None) == 0
    assert PagedRAGLLM(logprobs=True, top_logprobs=2).sampling({}).logprobs == 2 == \
        ChatPagedRAG(logprobs=True, top_logprobs=2).sampling({}).logprobs
    with pytest.raises(ValidationError, match="top_logprobs goes with logprobs=True"):
        PagedRAGLLM(logprobs=3, top_logprobs=2)
    with pytest.raises(ValidationError):
        ChatPagedRAG(logprobs=3)


def test_chatopenai_field_names_for_the_server_are_taken():
    """LangChain's vLLM recipe: VLLMOpenAI(openai_api_key="EMPTY", openai_api_base=".../v1")."""
    llm = PagedRAGLLM(openai_api_base="http://127.0.0.1:9/v1", openai_api_key="EMPTY", request_timeout=5)
    assert (llm.base_url, llm.api_key.get_secret_value(), llm.timeout) == ("http://127.0.0.1:9/v1", "EMPTY", 5.0)


def test_chatopenai_stop_string_and_none_n_and_temperature_are_accepted():
    """ChatOpenAI's stop is list[str] | str | None; its n and temperature may be None (the
    engine's defaults: one completion, temperature 1.0)."""
    chat = ChatPagedRAG(stop="\n", n=None, temperature=None)
    assert chat.sampling({}) == SamplingParams(temperature=1.0, max_tokens=None, n=1, stop=["\n"])
    assert PagedRAGLLM().sampling({}).max_tokens == 512  # langchain_community VLLM's max_new_tokens


def test_vllm_default_use_beam_search_is_ignored_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="pagedrag"):
        llm = PagedRAGLLM(use_beam_search=False)
    assert llm.model_kwargs == {} and "use_beam_search=False not used" in caplog.text
    with pytest.raises(ValidationError, match="use_beam_search=True is not supported.*LLM.beam_search"):
        PagedRAGLLM(use_beam_search=True)


def test_vllm_arguments_are_kept_without_a_routing_warning(recwarn):
    """langchain_community's VLLM fields mean the same here; best_of (= n) and ignore_eos are
    settings of their own, not unknown arguments that LangChain moves into model_kwargs."""
    community = pytest.importorskip("langchain_community.llms")
    vllm_arguments = {"model": None, "tensor_parallel_size": 1, "trust_remote_code": False, "n": 2, "best_of": 2,
                      "presence_penalty": 0.5, "frequency_penalty": 0.25, "temperature": 0.5, "top_p": 0.9,
                      "top_k": 5, "stop": ["\n\n"], "ignore_eos": True, "max_new_tokens": 3, "logprobs": 1,
                      "dtype": "auto", "download_dir": None, "vllm_kwargs": VLLM_KWARGS}
    assert set(vllm_arguments) <= get_pydantic_field_names(community.VLLM)
    llm = PagedRAGLLM(**vllm_arguments)
    assert not [w for w in recwarn if "model_kwargs" in str(w.message)] and llm.model_kwargs == {}
    assert llm.sampling({}) == SamplingParams(n=2, presence_penalty=0.5, frequency_penalty=0.25, temperature=0.5,
                                              top_p=0.9, top_k=5, stop=["\n\n"], ignore_eos=True, max_tokens=3,
                                              logprobs=1)


def test_a_call_stop_and_its_alias_must_agree():
    llm = PagedRAGLLM()
    assert llm.call_sampling({"stop_sequences": ["B"]}, ["B"]).stop == ["B"]
    with pytest.raises(ValueError, match="set the same thing"):
        llm.call_sampling({"stop_sequences": ["A"]}, ["B"])


def test_a_saved_model_loads_without_a_connection_warning(caplog):
    """dumpd spells max_retries out at its default: not a user's setting to warn about."""
    with caplog.at_level("WARNING", logger="pagedrag"):
        load(dumpd(ChatPagedRAG(engine_kwargs=VLLM_KWARGS)), valid_namespaces=["langchain_pagedrag"],
             allowed_objects=[ChatPagedRAG])
    assert "not used" not in caplog.text
