"""vLLM's offline chat options, its metrics names and the server's --chat-template."""

from __future__ import annotations

import argparse

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedrag import LLM, EngineArgs, SamplingParams
from pagedrag.entrypoints.async_engine import AsyncLLMEngine
from pagedrag.server import cli
from pagedrag.server.app import build_app
from pagedrag.server.background import BackgroundServer

GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512)


def test_chat_takes_content_parts_a_template_and_continue_final_message(llm):
    plain = llm.chat([{"role": "user", "content": "Name a color.\nOne word."}], GREEDY, use_tqdm=False)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Name a color."},
                                                   {"type": "text", "text": "One word."}]}], GREEDY, use_tqdm=False)[0]
    assert parts.prompt_token_ids == plain.prompt_token_ids
    own = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False,
                   chat_template="{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}",
                   add_generation_prompt=False)[0]
    assert own.prompt == "<user>hi"
    continued = llm.chat([{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi, I am"}],
                         GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert continued.prompt.rstrip().endswith("Hi, I am")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat([{"role": "user", "content": "x"}], GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match="text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], GREEDY)


def test_embedded_model_defaults_come_from_its_model_card(llm):
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p) == (0.2, 0.9)


def test_vllm_metric_names_for_its_dashboard():
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(max_model_len=256, num_gpu_blocks_override=32,
                                                        metrics_prefix="vllm"))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--served-model-name", "smol", "--chat-template", "{{ messages[0].content }}!"])
    config = cli.server_config_from(args, "smol")
    try:
        with BackgroundServer(build_app(engine, config)) as server:
            body = {"model": "smol", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
            assert httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
            tokens = httpx.post(server.base_url + "/tokenize", json={"prompt": "Hello!", "add_special_tokens": False})
            usage = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60).json()["usage"]
            assert usage["prompt_tokens"] == tokens.json()["count"]  # the operator's template: "Hello!"
            text = httpx.get(server.base_url + "/metrics").text
    finally:
        engine.shutdown()
    names = {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}
    for series in ("e2e_request_latency_seconds_count", "time_per_output_token_seconds_count",
                   "request_queue_time_seconds_count", "request_prefill_time_seconds_count",
                   "request_decode_time_seconds_count", "request_success_total", "prefix_cache_hits_total",
                   "kv_cache_usage_perc", "time_to_first_token_seconds_count"):
        assert f"vllm:{series}" in names, series
    assert 'finished_reason="length"' in text and 'model_name="' in text
