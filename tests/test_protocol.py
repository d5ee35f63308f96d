"""The server's request bodies (pagedrag.server.protocol): what today's openai SDK can send that
this server cannot honour is refused by name (a 400 through the server), never dropped while it
would change the answer; what OpenAI-compatible servers conventionally ignore is ignored."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pagedrag.server.protocol import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("fields, named", [
    ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "continuous_usage_stats"),
    ({"messages": [{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]},
     "function_call"),
    ({"messages": [{"role": "assistant", "content": None, "audio": {"id": "audio_1"}}]}, "audio"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream, as OpenAI and vLLM
])
def test_what_would_change_the_answer_is_refused_by_name(fields, named):
    with pytest.raises(ValidationError, match=named):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


@pytest.mark.parametrize("fields", [
    {"modalities": ["text"]}, {"user": "u1"}, {"store": False}, {"metadata": {"k": "v"}}, {"service_tier": "auto"},
    {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}},
])
def test_what_leaves_the_answer_as_it_is_is_accepted(fields):
    ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


@pytest.mark.parametrize("model, fields", [
    (CompletionRequest, {"prompt": "Hi", "echo": False, "suffix": ""}),
    (ChatCompletionRequest, {"messages": MESSAGES, "modalities": ["text"], "function_call": "none"}),
])
def test_known_fields_at_their_unused_value_are_not_called_unknown(model, fields, caplog):
    """A client that sends ``echo: false`` (the openai SDK's default for legacy completions) on
    every request must not put a warning in the log for each of them."""
    model.model_validate(fields)
    assert "unknown fields" not in caplog.text
    model.model_validate({**fields, "not_a_field": 1})
    assert "ignoring unknown fields ['not_a_field']" in caplog.text
