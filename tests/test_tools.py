"""Tool calling: plans and their grammars (compiled with xgrammar for the embedded
tokenizer), per-family parsers and streaming holdback, and chat template preparation."""

import json
import re
from types import SimpleNamespace

import pytest

from pagedrag.models.loader import load_tokenizer
from pagedrag.structured.compiler import GrammarCompiler
from pagedrag.tools import (PARSERS, ToolCall, ToolPlan, parser_for, plan_tools, prepare_conversation,
                            template_supports_tools)

EMBEDDED_VOCAB, EMBEDDED_EOS = 49152, 2


def tool(name, parameters=None, description=None):
    function = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def obj(properties, required=()):
    return {"type": "object", "properties": properties, "required": list(required)}


# (tool, valid arguments, invalid arguments). Properties are declared in alphabetical
# order: StructuredOutputsParams stores schemas with sorted keys, and xgrammar makes
# properties come in the order the schema lists them.
CORPUS = [
    (tool("get_weather", obj({"location": {"type": "string"},
                              "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["location"]),
          "Current weather in a city"),
     {"location": "Paris, France", "unit": "celsius"}, {"location": "Paris", "unit": "kelvin"}),
    (tool("web_search", obj({"max_results": {"type": "integer", "minimum": 1, "maximum": 20},
                             "query": {"type": "string"}}, ["query"])),
     {"max_results": 5, "query": "paged attention"}, {"max_results": "five", "query": "x"}),
    (tool("create_event", obj({
        "attendees": {"type": "array", "items": obj({"email": {"type": "string"}, "name": {"type": "string"}},
                                                    ["email"])},
        "start": obj({"date": {"type": "string"}, "time": {"type": "string"}}, ["date"]),
        "title": {"type": "string"}}, ["start", "title"])),
     {"attendees": [{"email": "a@example.com", "name": "Ann"}], "start": {"date": "2025-01-02", "time": "10:00"},
      "title": "Review"},
     {"start": {"date": "2025-01-02"}}),
    (tool("set_tags", obj({"item_id": {"type": "integer"},
                           "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}},
                          ["item_id", "tags"])),
     {"item_id": 7, "tags": ["red", "sale"]}, {"item_id": 7, "tags": []}),
    (tool("lookup", obj({"key": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}, ["key"])),
     {"key": 42}, {"key": True}),
    (tool("get_time"), {}, {"zone": "UTC"}),
    (tool("send_email", obj({"body": {"type": "string"}, "cc": {"type": ["string", "null"]},
                             "to": {"type": "string"}, "urgent": {"type": "boolean"}}, ["body", "to"])),
     {"body": "Hi", "cc": None, "to": "b@example.com", "urgent": False},
     {"body": "Hi", "to": "b@example.com", "urgent": "yes"}),
    (tool("calculate", obj({"a": {"type": "number"}, "b": {"type": "number"},
                            "op": {"type": "string", "enum": ["+", "-", "*", "/"]}}, ["a", "b", "op"])),
     {"a": 1.5, "b": -2, "op": "*"}, {"a": 1, "b": 2, "op": "%"}),
    (tool("book_flight", {  # as pydantic writes nested models: local $defs and $refs
        "$defs": {"Airport": obj({"code": {"type": "string", "enum": ["CDG", "JFK", "NRT"]}}, ["code"])},
        "type": "object",
        "properties": {"destination": {"$ref": "#/$defs/Airport"}, "origin": {"$ref": "#/$defs/Airport"},
                       "passengers": {"type": "integer", "minimum": 1}},
        "required": ["destination", "origin", "passengers"]}),
     {"destination": {"code": "NRT"}, "origin": {"code": "CDG"}, "passengers": 2},
     {"destination": {"code": "LHR"}, "origin": {"code": "CDG"}, "passengers": 2}),
    (tool("run_query", obj({"filters": {"type": "object", "additionalProperties": {"type": "string"}},
                            "sql": {"type": "string"}}, ["sql"])),
     {"filters": {"region": "eu"}, "sql": "SELECT 1"}, {"filters": {"region": 1}, "sql": "SELECT 1"}),
    (tool("translate", obj({"target": {"type": "string", "enum": ["de", "ja"]}, "text": {"type": "string"}},
                           ["target", "text"])),
     {"target": "ja", "text": "Grüße, 世界"}, {"target": "xx", "text": "hi"}),
]
CORPUS_IDS = [entry[0]["function"]["name"] for entry in CORPUS]
WEATHER = CORPUS[0][0]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, EMBEDDED_VOCAB, [EMBEDDED_EOS])


def accepts(compiler, params, text):
    matcher = compiler.matcher(params)
    return matcher.accept_string(text) and matcher.is_completed()


def call_text(plan, calls):
    """A "required" output for (name, arguments) pairs, each call's keys in the order
    the compiled schema lists them."""
    order = list(json.loads(plan.structured_outputs().json)["items"]["anyOf"][0]["properties"])
    values = [{"name": name, "arguments": arguments} for name, arguments in calls]
    return json.dumps([{key: value[key] for key in order} for value in values], ensure_ascii=False)


# ---- grammars that force calls ------------------------------------------------------
@pytest.mark.parametrize("entry", CORPUS, ids=CORPUS_IDS)
def test_named_grammar_accepts_the_arguments_and_parse_reads_them(compiler, entry):
    declared, valid, invalid = entry
    name = declared["function"]["name"]
    plan = plan_tools([WEATHER, declared] if declared is not WEATHER else [WEATHER],
                      {"type": "function", "function": {"name": name}})
    params = plan.structured_outputs()
    text = json.dumps(valid, ensure_ascii=False)
    assert accepts(compiler, params, text)
    assert not accepts(compiler, params, json.dumps(invalid))
    content, calls = plan.parse(text, PARSERS["smollm2"])
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [(name, valid)]
    assert calls[0].arguments == json.dumps(valid, ensure_ascii=False)


@pytest.fixture(scope="module")
def required_plan():
    return plan_tools([entry[0] for entry in CORPUS], "required")


@pytest.mark.parametrize("entry", CORPUS, ids=CORPUS_IDS)
def test_required_grammar_accepts_each_call_and_parse_reads_it(compiler, required_plan, entry):
    declared, valid, invalid = entry
    name = declared["function"]["name"]
    params = required_plan.structured_outputs()
    text = call_text(required_plan, [(name, valid)])
    assert accepts(compiler, params, text)
    assert not accepts(compiler, params, call_text(required_plan, [(name, invalid)]))
    content, calls = required_plan.parse(text, PARSERS["hermes"])
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [(name, valid)]


def test_required_grammar_takes_parallel_calls_only_when_allowed(compiler, required_plan):
    two = [(CORPUS[0][0]["function"]["name"], CORPUS[0][1]), (CORPUS[1][0]["function"]["name"], CORPUS[1][1])]
    single = plan_tools([CORPUS[0][0], CORPUS[1][0]], "required", parallel_tool_calls=False)
    assert accepts(compiler, required_plan.structured_outputs(), call_text(required_plan, two))
    assert not accepts(compiler, single.structured_outputs(), call_text(single, two))
    assert accepts(compiler, single.structured_outputs(), call_text(single, two[:1]))
    for plan in (required_plan, single):
        assert not accepts(compiler, plan.structured_outputs(), "[]")
        assert not accepts(compiler, plan.structured_outputs(), call_text(plan, [("undeclared", {})]))
    _, calls = required_plan.parse(call_text(required_plan, two), PARSERS["hermes"])
    assert [c.name for c in calls] == ["get_weather", "web_search"]


def test_auto_without_parallel_calls_keeps_the_first_call_the_model_wrote():
    """parallel_tool_calls=false with "auto": the grammar does not bind the model, so the
    calls it wrote past the first are dropped (vLLM's behaviour; OpenAI promises at most one)."""
    two = "".join(f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>\n' for name in ("a", "b"))
    tools = [{"type": "function", "function": {"name": name}} for name in ("a", "b")]
    for parallel, expected in ((True, ["a", "b"]), (False, ["a"])):
        _, calls = plan_tools(tools, "auto", parallel_tool_calls=parallel).parse(two, PARSERS["hermes"])
        assert [call.name for call in calls] == expected


def test_required_calls_are_written_name_first(required_plan):
    order = json.loads(required_plan.structured_outputs().json)["items"]["anyOf"][0]["properties"]
    assert list(order) == ["name", "arguments"]


NAMED_F = {"type": "function", "function": {"name": "f"}}


def test_required_rebases_refs_in_schemas_only(compiler):
    """A "$ref" key inside data (a const) is the value the schema names, not a reference:
    only schemas (subschemas and $ref targets, wherever they sit) are rebased."""
    pointer = {"$ref": "#/definitions/Pet"}
    parameters = {"type": "object", "properties": {"ptr": {"const": pointer}, "n": {"$ref": "#/x-defs/N"}},
                  "required": ["ptr", "n"], "additionalProperties": False,
                  "x-defs": {"N": {"$ref": "#/x-defs/M"}, "M": {"type": "integer"}}}
    plan = plan_tools([tool("link", parameters)], "required")
    text = '[{"name": "link", "arguments": {"ptr": {"$ref":"#/definitions/Pet"}, "n": 1}}]'  # xgrammar's const
    assert accepts(compiler, plan.structured_outputs(), text)
    assert not accepts(compiler, plan.structured_outputs(), text.replace("1}}]", '"x"}}]'))
    assert plan.tools[0]["function"]["parameters"]["properties"]["ptr"]["const"] == pointer


@pytest.mark.parametrize("parameters", [
    {"$id": "https://example.com/args", "type": "object", "properties": {"q": {"type": "string", "enum": ["a"]}}},
    {"$ref": "#/definitions/A", "definitions": {"A": obj({"q": {"type": "string", "enum": ["a"]}})}},
    {"anyOf": [obj({"q": {"type": "string", "enum": ["a"]}}, ["q"]), obj({"r": {"type": "integer"}}, ["r"])]},
], ids=["root-id", "root-ref", "root-anyOf"])
def test_parameters_with_a_root_id_ref_or_anyof_work_named_and_required(compiler, parameters):
    """A root $id is an annotation for either choice; a root $ref / anyOf gets no "type"
    beside it (the grammar would drop it), its alternatives being objects already."""
    for choice in (NAMED_F, "required"):
        plan = plan_tools([tool("f", parameters)], choice)
        text = call_text(plan, [("f", {"q": "a"})]) if choice == "required" else json.dumps({"q": "a"})
        assert accepts(compiler, plan.structured_outputs(), text), (choice, text)
        assert not accepts(compiler, plan.structured_outputs(), text.replace('"a"', '"b"')), choice


@pytest.mark.parametrize("parameters", [
    {"$ref": "#/definitions/S", "definitions": {"S": {"type": "string"}}},
    {"anyOf": [obj({}), {"type": "integer"}]},
    {"$ref": "#"},
])
def test_parameters_whose_root_ref_or_anyof_allows_non_objects_are_refused(parameters):
    with pytest.raises(ValueError, match="must be the schema of an object: its root '(\\$ref|anyOf)' must allow "
                                         "only objects"):
        plan_tools([tool("f", parameters)], NAMED_F)


def test_forced_output_that_does_not_parse_is_content():
    named = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    required = plan_tools([WEATHER], "required")
    for plan, text in ((named, '{"location": "Par'), (named, "[1]"), (required, '[{"name": "get_weather", "argu'),
                       (required, "{}"), (required, "[" * 100_000)):
        assert plan.parse(text, PARSERS["hermes"]) == (text, [])


def test_auto_and_none_plans_leave_the_text_free():
    auto = plan_tools([WEATHER], None)
    none = plan_tools([WEATHER], "none")
    assert (auto.choice, none.choice) == ("auto", "none")
    assert auto.structured_outputs() is None and none.structured_outputs() is None
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Oslo"}}\n</tool_call>'
    assert none.parse(text, PARSERS["hermes"]) == (text, [])
    content, calls = auto.parse(text, PARSERS["hermes"])
    assert content is None and calls[0].name == "get_weather"


# ---- plan_tools ------------------------------------------------------------------------
def test_no_tools_means_no_plan():
    for tools in (None, []):
        for choice in (None, "none", "auto"):
            assert plan_tools(tools, choice) is None


def test_plan_fills_defaults_and_copies_schemas():
    schema = obj({"q": {"type": "string"}})
    del schema["type"]
    plan = plan_tools([tool("a", schema, "does a"), tool("b")], None, None)
    assert plan == ToolPlan(tools=(tool("a", {"type": "object", **schema}, "does a"),
                                   tool("b", {"type": "object", "properties": {}})),
                            choice="auto", named=None, parallel=True)
    schema["properties"]["q"]["type"] = "integer"
    assert plan.tools[0]["function"]["parameters"]["properties"]["q"]["type"] == "string"


@pytest.mark.parametrize("tools, choice, parallel, error, message", [
    ({"type": "function"}, None, True, TypeError, "tools must be a list"),
    (["get_weather"], None, True, TypeError, r"tools\[0\] must be an object"),
    ([{"type": "retrieval", "function": {"name": "a"}}], None, True, ValueError, r"tools\[0\].type must be"),
    ([{"type": "function", "function": {"name": "a"}, "extra": 1}], None, True, ValueError, "unknown fields"),
    ([{"type": "function"}], None, True, TypeError, r"tools\[0\].function must be an object"),
    ([tool("has space")], None, True, ValueError, r"name must match"),
    ([tool("x" * 65)], None, True, ValueError, r"name must match"),
    ([tool("a"), tool("b"), tool("a")], None, True, ValueError, r"unique; \['a'\]"),
    ([tool("a", ["not", "a", "schema"])], None, True, TypeError, "parameters must be a JSON schema object"),
    ([tool("a", {"type": "string"})], None, True, ValueError, "schema of an object"),
    ([tool("a", {"type": "object", "default": float("nan")})], None, True, ValueError, "is not JSON"),
    ([{"type": "function", "function": {"name": "a", "description": 3}}], None, True, TypeError, "description"),
    ([{"type": "function", "function": {"name": "a", "strict": "yes"}}], None, True, TypeError, "strict"),
    ([tool(f"t{i}") for i in range(129)], None, True, ValueError, "at most 128 tools"),
    ([tool("a")], "any", True, ValueError, "tool_choice must be"),
    ([tool("a")], 3, True, TypeError, "tool_choice must be a string"),
    ([tool("a")], {"type": "function", "function": {"name": "b"}}, True, ValueError, "'b', which is not among"),
    ([tool("a")], {"type": "function", "name": "a"}, True, ValueError, "named tool_choice must be"),
    (None, "required", True, ValueError, "'required' needs tools"),
    (None, {"type": "function", "function": {"name": "a"}}, True, ValueError, "none were given"),
    ([tool("a")], "auto", "yes", TypeError, "parallel_tool_calls"),
])
def test_plan_tools_rejects(tools, choice, parallel, error, message):
    with pytest.raises(error, match=message):
        plan_tools(tools, choice, parallel)


def test_tool_call_ids_are_fresh_and_openai_shaped():
    calls = [ToolCall.new("f", {"a": 1}) for _ in range(50)]
    assert len({call.id for call in calls}) == 50
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id) for call in calls)
    assert calls[0].to_openai() == {"id": calls[0].id, "type": "function",
                                    "function": {"name": "f", "arguments": '{"a": 1}'}}


# ---- parsers ---------------------------------------------------------------------------
def named_arguments(calls):
    return [(call.name, json.loads(call.arguments)) for call in calls]


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("text, content, calls", [
    (HERMES_CALL, None, [("get_weather", {"location": "Paris"})]),
    ("Let me check.\n" + HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Oslo"), "Let me check.",
     [("get_weather", {"location": "Paris"}), ("get_weather", {"location": "Oslo"})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}', None, [("f", {"a": 1})]),  # unclosed, string args
    ('<tool_call>{"name": "f"}</tool_call> then text', "then text", [("f", {})]),
    ("<tool_call>{not json}</tool_call> tail", "<tool_call>{not json}</tool_call> tail", []),
    ("bad <tool_call>[1]</tool_call> good " + HERMES_CALL, "bad <tool_call>[1]</tool_call> good",
     [("get_weather", {"location": "Paris"})]),
    ("  just prose  ", "  just prose  ", []),
])
def test_hermes_parser(text, content, calls):
    parsed_content, parsed = PARSERS["hermes"].parse(text)
    assert (parsed_content, named_arguments(parsed)) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_weather", "parameters": {"location": "Paris"}}', None, [("get_weather", {"location": "Paris"})]),
    ('<|python_tag|>{"name": "f", "arguments": {"q": "a; b"}}', None, [("f", {"q": "a; b"})]),
    ('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": [1]}}', None, [("f", {}), ("g", {"x": [1]})]),
    ('\n {"name": "f", "parameters": {}} \n', None, [("f", {})]),
    ('The answer is {"name": "f", "parameters": {}}', 'The answer is {"name": "f", "parameters": {}}', []),
    ('{"name": "f", "parameters": {}} and more', '{"name": "f", "parameters": {}} and more', []),
    ('{"name": "f", "parameters": {}}; {"oops": 1}', '{"name": "f", "parameters": {}}; {"oops": 1}', []),
    ('{"value": 3}', '{"value": 3}', []),
])
def test_llama3_json_parser(text, content, calls):
    parsed_content, parsed = PARSERS["llama3_json"].parse(text)
    assert (parsed_content, named_arguments(parsed)) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>[{"name": "get_weather", "arguments": {"location": "Paris"}}]</tool_call>', None,
     [("get_weather", {"location": "Paris"})]),
    ('<tool_call>[\n{"name": "f", "arguments": {}},\n{"name": "g", "arguments": {"n": 2}}\n]</tool_call>', None,
     [("f", {}), ("g", {"n": 2})]),
    ('Sure! <tool_call>{"name": "f", "arguments": {"a": "ü"}}</tool_call>', "Sure!", [("f", {"a": "ü"})]),
    ("<tool_call>[]</tool_call>", None, []),
    ('<tool_call>[{"name": "f", "arguments": {}}, {"arguments": {}}]</tool_call>',
     '<tool_call>[{"name": "f", "arguments": {}}, {"arguments": {}}]</tool_call>', []),
    ('<tool_call>[{"name": "f", "arguments": 3}]</tool_call>', '<tool_call>[{"name": "f", "arguments": 3}]</tool_call>',
     []),
    ("I cannot help with that.", "I cannot help with that.", []),
])
def test_smollm2_parser(text, content, calls):
    parsed_content, parsed = PARSERS["smollm2"].parse(text)
    assert (parsed_content, named_arguments(parsed)) == (content, calls)


GARBAGE = ["", " ", "<tool_call>", "</tool_call>", "<tool_call></tool_call>", "<tool_call>null", "<|python_tag|>",
           ";", "{};{}", '{"name": 1}', '{"name": "", "arguments": {}}', '{"name": "f", "parameters": []}',
           "[" * 100_000, "<tool_call>" + "{" * 100_000, '<tool_call>{"name": "f"}</tool_call' + "]" * 5,
           "\ud800", "<tool_call><tool_call>{}</tool_call>"]
SAMPLES = {
    "hermes": ("Let me look that up. ", HERMES_CALL),
    "llama3_json": ("", '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Paris"}}'),
    "smollm2": ("Sure.\n", '<tool_call>[{"name": "get_weather", "arguments": {"location": "Paris"}}]</tool_call>'),
}


@pytest.mark.parametrize("name", PARSERS)
def test_parsers_never_raise_and_keep_unread_text(name):
    lead, call = SAMPLES[name]
    texts = GARBAGE + [(lead + call)[:end] for end in range(len(lead + call) + 1)]
    for text in texts:
        content, calls = PARSERS[name].parse(text)
        if not calls:
            assert content in (text, None)


@pytest.mark.parametrize("name", PARSERS)
def test_holdback_never_releases_part_of_a_call(name):
    parser = PARSERS[name]
    lead, call = SAMPLES[name]
    text = lead + call
    released = ""
    for end in range(len(text) + 1):
        so_far = text[:end]
        now = so_far[:len(so_far) - parser.holdback(so_far)]
        assert now.startswith(released) and lead.startswith(now), (so_far, now)
        released = now
    content, calls = parser.parse(text)
    assert named_arguments(calls) == [("get_weather", {"location": "Paris"})]
    assert content == (lead.strip() or None)


@pytest.mark.parametrize("name, text, held", [
    ("hermes", "a < b", 0), ("hermes", "see <tool_c", 7), ("hermes", "see <tool_cx", 0), ("hermes", "x <", 1),
    ("smollm2", "ok <tool_call>[", 12), ("llama3_json", "Sure, {", 0), ("llama3_json", "  ", 2),
    ("llama3_json", "<|py", 4), ("llama3_json", "<|im", 0), ("llama3_json", " {\"na", 5),
])
def test_holdback_of_plain_text(name, text, held):
    assert PARSERS[name].holdback(text) == held


@pytest.mark.parametrize("name", PARSERS)
def test_rendered_calls_parse_back(name):
    calls = [{"name": "get_weather", "arguments": {"location": "Zürich"}}, {"name": "get_time", "arguments": {}}]
    content, parsed = PARSERS[name].parse(PARSERS[name].render_calls(calls))
    assert content is None and named_arguments(parsed) == [(c["name"], c["arguments"]) for c in calls]


def family(template):
    return parser_for(SimpleNamespace(chat_template=template)).name


def test_parser_for_reads_the_family(tokenizer):
    assert parser_for(tokenizer).name == "smollm2"
    assert parser_for(None).name == "smollm2"
    assert family("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert family({"default": "x", "tool_use": "<tool_call>"}) == "hermes"
    assert family("<|start_header_id|>{{ 'Environment: ipython' }}<|python_tag|>") == "llama3_json"
    assert family("<|im_start|><|start_header_id|><tool_call>") == "hermes"
    assert parser_for(SimpleNamespace(chat_template=None), "meta-llama/Llama-3.2-1B-Instruct").name == "llama3_json"
    assert parser_for(SimpleNamespace(chat_template=None), "Qwen/Qwen2.5-0.5B-Instruct").name == "hermes"
    assert parser_for(tokenizer, "HuggingFaceTB/SmolLM2-135M-Instruct").name == "smollm2"


# ---- chat templates ---------------------------------------------------------------------
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"location": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }},{% endfor %}|{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}|"
    "{% endfor %}")


def test_smollm2_template_gets_tools_calls_and_results_as_text(tokenizer):
    plan = plan_tools([WEATHER, CORPUS[1][0]], "auto")
    original = json.loads(json.dumps(CONVERSATION))
    supports_tools = template_supports_tools(tokenizer)
    messages, kwargs = prepare_conversation(CONVERSATION, plan, parser_for(tokenizer), supports_tools)
    assert kwargs == {} and CONVERSATION == original
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert text.startswith("<|im_start|>system\n") and "<tools>[" in text
    assert '"name": "get_weather"' in text and '"name": "web_search"' in text
    assert ('<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": {"location": "Paris", '
            '"unit": "celsius"}}]</tool_call><|im_end|>') in text
    assert '<|im_start|>tool\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("system, joined", [
    ("Be brief.", lambda prompt: f"Be brief.\n{prompt}"),
    ([{"type": "text", "text": "Be brief."}],
     lambda prompt: [{"type": "text", "text": "Be brief."}, {"type": "text", "text": prompt}]),
])
def test_tools_join_an_existing_system_message(system, joined):
    plan = plan_tools([WEATHER], "auto")
    parser = PARSERS["hermes"]
    messages, _ = prepare_conversation([{"role": "system", "content": system}, *CONVERSATION], plan, parser, False)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[0]["content"] == joined(parser.system_prompt(plan.tools))
    assert messages[2]["content"].startswith("<tool_call>\n{")


def test_template_with_tools_gets_them_natively(tokenizer):
    plan = plan_tools([WEATHER], "none")
    template = SimpleNamespace(chat_template=TOOL_TEMPLATE)
    assert template_supports_tools(template) and not template_supports_tools(tokenizer)
    messages, kwargs = prepare_conversation(CONVERSATION, plan, PARSERS["hermes"], True)
    assert kwargs == {"tools": [WEATHER]}
    assert messages[1]["content"] == "" and messages[2] == CONVERSATION[2]
    text = tokenizer.apply_chat_template(messages, chat_template=TOOL_TEMPLATE, tokenize=False, **kwargs)
    assert text == ('TOOLS:get_weather,|[user]Weather in Paris?|[assistant]CALL get_weather {"location": "Paris", '
                    '"unit": "celsius"}|[tool]{"temperature": 21}|')


def test_tool_results_in_parts_stay_parts():
    messages, _ = prepare_conversation(
        [{"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "21"}]}], None,
        PARSERS["smollm2"], False)
    assert messages[0]["content"] == [{"type": "text", "text": "<tool_response>"}, {"type": "text", "text": "21"},
                                      {"type": "text", "text": "</tool_response>"}]


@pytest.mark.parametrize("message, text", [
    ({"role": "assistant", "tool_calls": {"id": "x"}}, "must be a list"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}, r"tool_calls\[0\] must"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}, "name must be"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{x"}}]},
     "arguments must be the JSON text of an object"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[]"}}]},
     "arguments must be"),
    ({"role": "user", "content": "hi", "tool_calls": []}, "only assistant messages"),
    ({"role": "tool", "tool_call_id": "c", "content": None}, "tool message's content"),
])
@pytest.mark.parametrize("supports_tools", [True, False])
def test_prepare_conversation_rejects(message, text, supports_tools):
    with pytest.raises(ValueError, match=text):
        prepare_conversation([message], None, PARSERS["smollm2"], supports_tools)
