"""Structured outputs: every completion fits its constraint (JSON schema, any JSON object,
regex, choice, grammar), with greedy and random sampling, n > 1, stop strings, prefix
caching, preemption (both modes) and asynchronous scheduling, on the embedded model; a
constraint that cannot compile is a clear error, and fails nothing else."""

import json
import re

import jsonschema
import pytest

from pagedrag import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from schema_corpus import RAG_ANSWER, SCHEMAS

QUESTIONS = [
    "Context: [0] Paris is the capital of France. [1] Berlin is the capital of Germany.\n"
    "Question: What is the capital of France? Reply in JSON.",
    "Describe a typical customer of a bicycle shop as JSON.",
]
ENGINE = {"max_model_len": 1024, "max_num_seqs": 16, "seed": 0}


@pytest.fixture(scope="module")
def llm():
    return LLM(**ENGINE)


def chat_prompt(llm: LLM, question: str) -> dict:
    return llm.apply_chat_template([{"role": "user", "content": question}])


def check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def test_every_schema_of_the_corpus_holds_greedy_and_sampled(llm):
    """All schemas x questions in one batch: greedy, and sampled with n=2."""
    prompts, params, schemas = [], [], []
    for schema in SCHEMAS.values():
        for question in QUESTIONS:
            for sampling in ({"temperature": 0}, {"temperature": 1.0, "n": 2, "seed": 7}):
                prompts.append(chat_prompt(llm, question))
                params.append(SamplingParams(max_tokens=320, structured_outputs=StructuredOutputsParams(json=schema),
                                             **sampling))
                schemas.append(schema)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, schema in zip(outputs, schemas):
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            check_json(completion.text, schema)


@pytest.mark.parametrize("constraint, check", [
    ({"choice": ["positive", "negative", "neutral"]}, lambda t: t in ("positive", "negative", "neutral")),
    ({"regex": r"[A-Z][a-z]{2,8} [0-9]{4}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{4}", t)),
    ({"grammar": 'root ::= "The answer is " [0-9] [0-9]? "."'}, lambda t: re.fullmatch(r"The answer is \d\d?\.", t)),
    ({"grammar": 'start: "yes" | "no"'}, lambda t: t in ("yes", "no")),  # Lark
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
])
def test_other_constraints(llm, constraint, check):
    params = [SamplingParams(temperature=t, max_tokens=200, seed=1, n=n, structured_outputs=constraint)
              for t, n in ((0, 1), (0.8, 3))]
    outputs = llm.generate([chat_prompt(llm, QUESTIONS[0])] * 2, params, use_tqdm=False)
    texts = [c.text for o in outputs for c in o.outputs]
    assert len(texts) == 4
    if "json_object" in constraint:  # any JSON may run long on a small model: check what finished
        texts = [c.text for o in outputs for c in o.outputs if c.finish_reason == "stop"]
    assert texts and all(check(text) for text in texts), texts


def test_guided_decoding_is_the_older_name(llm):
    older = SamplingParams(temperature=0, max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["a", "b"]))
    assert older.structured_outputs == StructuredOutputsParams(choice=["a", "b"]) and older.guided_decoding is None
    as_dict = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": ["a", "b"]})
    outputs = llm.generate([QUESTIONS[0]] * 2, [older, as_dict], use_tqdm=False)
    assert outputs[0].outputs[0].text == outputs[1].outputs[0].text in ("a", "b")


@pytest.mark.parametrize("constraint, message", [
    ({}, "exactly one of"),
    ({"json": {"type": "object"}, "regex": "a+"}, "exactly one of"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"whitespace_pattern": " *", "json_object": True}, "whitespace_pattern"),
    ({"choice": []}, "non-empty list"),
    ({"frobnicate": 1}, "unknown structured_outputs fields"),
])
def test_malformed_constraints_are_refused_when_made(constraint, message):
    with pytest.raises((ValueError, TypeError), match=message):
        SamplingParams(structured_outputs=constraint)


@pytest.mark.parametrize("constraint, message", [
    ({"json": {"type": "frobnicate"}}, "JSON schema cannot be compiled"),
    ({"json": {"$ref": "#/$defs/missing"}}, "JSON schema cannot be compiled"),
    ({"regex": "(unclosed"}, "regex cannot be compiled"),
    ({"grammar": "root ::= undefined_rule"}, "grammar cannot be compiled"),
    ({"grammar": "root ::= root"}, "accepts no output"),  # no token can start it
])
def test_constraints_that_cannot_compile_fail_alone(llm, constraint, message):
    """The bad request is refused when added; nothing is queued, and the engine goes on."""
    with pytest.raises(ValueError, match=message):
        llm.generate([QUESTIONS[0], QUESTIONS[1]],
                     [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, structured_outputs=constraint)],
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate([QUESTIONS[0]], SamplingParams(max_tokens=3), use_tqdm=False)[0].finished


def test_json_object_without_free_whitespace_is_compact(llm):
    """disable_any_whitespace holds for json_object too (it held for schemas only)."""
    grammars = llm.llm_engine.inputs.grammars
    compact = grammars.matcher(StructuredOutputsParams(json_object=True, disable_any_whitespace=True))
    free = grammars.matcher(StructuredOutputsParams(json_object=True))
    assert free.accept_string('{ "a": 1') and not compact.accept_string('{ "a": 1')


def test_a_request_whose_bans_leave_no_grammar_token_fails_alone(llm):
    """allowed_token_ids that exclude every token the grammar allows: that request ends with
    an error; the other one in the batch completes."""
    tokenizer = llm.get_tokenizer()
    only_x = tokenizer.encode("x", add_special_tokens=False)
    params = [SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=only_x,
                             structured_outputs={"choice": ["yes", "no"]}),
              SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": ["yes", "no"]})]
    outputs = llm.generate([QUESTIONS[0]] * 2, params, use_tqdm=False)
    assert outputs[0].error and "structured output" in outputs[0].error
    assert outputs[1].error is None and outputs[1].outputs[0].text in ("yes", "no")


def test_stop_strings_and_ignore_eos_with_a_grammar(llm):
    schema = SCHEMAS["grade_document"]
    stopped, unstoppable = llm.generate(
        [chat_prompt(llm, QUESTIONS[0])] * 2,
        [SamplingParams(temperature=0, max_tokens=64, structured_outputs={"json": schema}, stop=['"binary_score"']),
         SamplingParams(temperature=0, max_tokens=64, structured_outputs={"json": schema}, ignore_eos=True)],
        use_tqdm=False)
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == '"binary_score"'
    assert '"binary_score"' not in stopped.outputs[0].text
    # a complete grammar ends the output even when EOS is ignored
    assert unstoppable.outputs[0].finish_reason == "stop"
    check_json(unstoppable.outputs[0].text, schema)


def test_prefix_cache_hits_do_not_change_constrained_outputs(llm):
    prompt = chat_prompt(llm, QUESTIONS[0] + " " + "context " * 40)
    params = SamplingParams(temperature=0, max_tokens=200, structured_outputs={"json": RAG_ANSWER})
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    check_json(second.outputs[0].text, RAG_ANSWER)


def constrained_batch(llm: LLM) -> list:
    prompts = [chat_prompt(llm, q + f" (case {i})") for i in range(4) for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=160, structured_outputs={"json": SCHEMAS["person"]})
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_batch(llm) -> list:
    """constrained_batch on the module's plain engine, run once: every engine below must match it."""
    return constrained_batch(llm)


@pytest.mark.parametrize("engine_kwargs", [
    {"num_gpu_blocks_override": 20, "max_model_len": 256, "preemption_mode": "recompute"},
    {"num_gpu_blocks_override": 20, "max_model_len": 256, "preemption_mode": "swap", "swap_space": 0.05},
    {"async_scheduling": True},
], ids=["preempt-recompute", "preempt-swap", "async-scheduling"])
def test_preemption_and_async_scheduling_keep_outputs(llm, plain_batch, engine_kwargs):
    """The grammar's state moves with its request: a pool too small for the batch (requests
    preempted and resumed; 20 blocks, since the batch shares its prompts' prefix blocks) and
    asynchronous scheduling give the same tokens as plain runs."""
    expected = plain_batch
    other = LLM(**{**ENGINE, "max_model_len": 512, **engine_kwargs})
    got = constrained_batch(other)
    if "num_gpu_blocks_override" in engine_kwargs:
        assert other.stats()["num_preemptions"] > 0
    assert got == expected
    tokenizer = llm.get_tokenizer()
    for token_ids in got:
        check_json(tokenizer.decode(token_ids, skip_special_tokens=True), SCHEMAS["person"])
