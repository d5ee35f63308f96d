"""Every JSON Schema draft 2020-12 keyword, with what pagedrag does with it: enforced by
the grammar (a conforming value passes, a violating one cannot be generated), refused when
the request is made (a ValueError naming the keyword and its path), or an annotation that
constrains nothing. Also regex features and grammar errors. xgrammar's matcher is driven
directly over a byte-level vocabulary: no model. docs/structured_outputs_keywords.md is
this file as a table.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import jsonschema
import pytest
import xgrammar

from model_fixtures import make_tokenizer
from pagedrag import SamplingParams, StructuredOutputsParams
from pagedrag.structured.compiler import GrammarCompiler, choice_grammar
from pagedrag.structured.masks import allowed_tokens
from pagedrag.structured.schema_support import ASCII_CLASSES, LITERAL_ESCAPES, check_regex

# The keywords of draft 2020-12's vocabularies (core, applicator, unevaluated, validation,
# meta-data, format-annotation, content), and draft-07 names xgrammar also reads.
KEYWORDS_2020_12 = {
    "$schema", "$id", "$ref", "$anchor", "$dynamicRef", "$dynamicAnchor", "$vocabulary", "$comment", "$defs",
    "prefixItems", "items", "contains", "additionalProperties", "properties", "patternProperties",
    "dependentSchemas", "propertyNames", "if", "then", "else", "allOf", "anyOf", "oneOf", "not",
    "unevaluatedItems", "unevaluatedProperties",
    "type", "const", "enum", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "maxContains", "minContains",
    "maxProperties", "minProperties", "required", "dependentRequired",
    "title", "description", "default", "deprecated", "readOnly", "writeOnly", "examples",
    "format", "contentEncoding", "contentMediaType", "contentSchema",
}
LEGACY = {"definitions", "dependencies", "additionalItems", "$recursiveRef"}


@dataclass
class Case:
    keyword: str
    outcome: str  # "enforced", "refused" or "annotation"
    schema: object
    good: list[str] = field(default_factory=list)  # JSON texts the grammar must accept
    bad: list[str] = field(default_factory=list)  # JSON texts it must reject
    path: str = "$"  # where a refusal points

    def __str__(self) -> str:
        return f"{self.keyword}-{self.outcome}-{json.dumps(self.schema)[:40]}"


def enforced(keyword, schema, good, bad):
    return Case(keyword, "enforced", schema, good, bad)


def refused(keyword, schema, path="$"):
    return Case(keyword, "refused", schema, path=path)


def annotation(keyword, schema, good):
    return Case(keyword, "annotation", schema, good)


INT, STR = {"type": "integer"}, {"type": "string"}
ABC = {"type": "string", "enum": ["a", "b", "c"]}
OBJ = {"type": "object", "properties": {"a": INT, "b": INT}}
DIGITS = {"type": "string", "pattern": "^[0-9]{3}$"}

CASES = [
    # core
    annotation("$schema", {"$schema": "https://json-schema.org/draft/2020-12/schema", **INT}, ["1"]),
    annotation("$id", {"$id": "https://example.com/s", **INT}, ["1"]),
    refused("$id", {"type": "object", "properties": {"a": {"$id": "https://example.com/a", **INT}}},
            "$.properties.a"),
    enforced("$ref", {"$defs": {"i": INT}, "$ref": "#/$defs/i"}, ["1"], ['"x"']),
    enforced("$ref", {"type": "object", "properties": {"c": {"$ref": "#"}}}, ['{"c":{}}'], ['{"c":1}']),
    refused("$ref", {"$defs": {"i": {"$anchor": "i", **INT}}, "$ref": "#i"}),
    refused("$ref", {"$ref": "https://example.com/schema.json"}),
    refused("maximum", {"$defs": {"i": INT}, "$ref": "#/$defs/i", "maximum": 3}),
    # a $ref target is checked wherever it sits (xgrammar reads it, and drops what it does not enforce)
    refused("not", {"components": {"schemas": {"Pet": {"type": "object", "properties": {
        "age": {"type": "integer", "not": {"const": 3}}}}}}, "$ref": "#/components/schemas/Pet"},
        "$.components.schemas.Pet.properties.age"),
    refused("minimum", {"x-defs": {"N": {"minimum": 5, "maximum": 6}}, "type": "object",
                        "properties": {"n": {"$ref": "#/x-defs/N"}}}, "$.x-defs.N"),
    refused("not", {"then": {"type": "integer", "not": {"const": 3}}, "$ref": "#/then"}, "$.then"),
    # a URI fragment: xgrammar decodes its percent-escapes, so the check does too
    refused("not", {"$defs": {"Small Int": {"type": "integer", "not": {"const": 3}}},
                    "$ref": "#/$defs/Small%20Int"}, "$.$defs['Small Int']"),
    enforced("maxLength", {"x-defs": {"S": {"type": "string", "maxLength": 3}}, "$ref": "#/x-defs/S"},
             ['"abc"'], ['"abcd"']),
    enforced("$ref", {"x-defs": {"T": {"type": "object", "properties": {"c": {"$ref": "#/x-defs/T"}}}},
                      "$ref": "#/x-defs/T"}, ['{"c":{"c":{}}}'], ['{"c":1}']),
    enforced("$ref", {"x-list": [INT], "$ref": "#/x-list/0"}, ["1"], ['"x"']),
    annotation("$anchor", {"$anchor": "here", **INT}, ["1"]),
    refused("$dynamicRef", {"$dynamicAnchor": "n", "type": "object",
                            "properties": {"c": {"$dynamicRef": "#n"}}}, "$.properties.c"),
    annotation("$dynamicAnchor", {"$dynamicAnchor": "n", **INT}, ["1"]),
    annotation("$vocabulary", {"$vocabulary": {"https://json-schema.org/draft/2020-12/vocab/core": True}, **INT},
               ["1"]),
    annotation("$comment", {"$comment": "an integer", **INT}, ["1"]),
    enforced("$defs", {"$defs": {"s": STR}, "type": "array", "items": {"$ref": "#/$defs/s"}, "maxItems": 2},
             ['["x"]'], ["[1]"]),
    enforced("definitions", {"definitions": {"i": INT}, "$ref": "#/definitions/i"}, ["1"], ['"x"']),
    # applicator
    enforced("prefixItems", {"type": "array", "prefixItems": [INT, STR], "items": False}, ['[1,"x"]'],
             ['["x",1]', '[1,"x",2]']),
    enforced("items", {"type": "array", "items": INT, "maxItems": 3}, ["[1,2]"], ['["x"]']),
    enforced("items", {"type": "array", "prefixItems": [INT], "items": False}, ["[1]"], ["[1,2]"]),
    refused("items", {"items": INT}),
    # draft 2019-09's name: no constraint in 2020-12 (xgrammar still narrows to it, which is safe)
    annotation("additionalItems", {"type": "array", "prefixItems": [INT], "additionalItems": False}, ["[1]"]),
    refused("contains", {"type": "array", "items": ABC, "contains": {"const": "b"}}),
    enforced("additionalProperties", {"type": "object", "additionalProperties": INT}, ['{"x":1}'], ['{"x":"y"}']),
    enforced("additionalProperties", {**OBJ, "additionalProperties": False}, ['{"a":1}'], ['{"c":1}']),
    enforced("properties", OBJ, ['{"a":1}', "{}"], ['{"a":"x"}']),
    refused("properties", {"properties": {"a": INT}, "required": ["a"]}),
    enforced("patternProperties", {"type": "object", "patternProperties": {"^x[0-9]$": INT},
                                   "additionalProperties": False}, ['{"x1":1}'], ['{"x1":"s"}', '{"y":1}']),
    refused("patternProperties", {"type": "object", "properties": {"x1": INT},
                                  "patternProperties": {"^x": {"type": "integer", "minimum": 5}}}),
    refused("patternProperties", {"type": "object", "patternProperties": {"(?=x)x": INT}}),
    refused("dependentSchemas", {**OBJ, "dependentSchemas": {"a": {"required": ["b"]}}}),
    refused("dependencies", {**OBJ, "dependencies": {"a": ["b"]}}),
    enforced("propertyNames", {"type": "object", "propertyNames": {"pattern": "^x[0-9]$"},
                               "additionalProperties": INT}, ['{"x1":1}'], ['{"y":1}']),
    enforced("propertyNames", {"type": "object", "propertyNames": {"maxLength": 2}, "additionalProperties": INT},
             ['{"ab":1}'], ['{"abc":1}']),
    refused("propertyNames", {**OBJ, "propertyNames": {"maxLength": 0}}),
    refused("if", {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}, "else": {"maximum": 2}}),
    annotation("then", {"type": "integer", "then": {"maximum": 7}}, ["9"]),
    annotation("else", {"type": "integer", "else": {"maximum": 7}}, ["9"]),
    enforced("allOf", {"allOf": [{"type": "integer", "maximum": 3}]}, ["3"], ["4", '"x"']),
    refused("allOf", {"allOf": [INT, {"type": "integer", "minimum": 3}]}),
    refused("maximum", {"maximum": 10, "allOf": [{"type": "integer", "minimum": 3}]}),
    enforced("anyOf", {"anyOf": [INT, STR]}, ["1", '"x"'], ["null"]),
    refused("required", {"required": ["a"], "anyOf": [{"type": "object", "properties": {"a": INT}}]}),
    enforced("oneOf", {"oneOf": [INT, STR]}, ["1", '"x"'], ["null"]),
    # a nullable branch also matches null, where "required" holds vacuously: not discriminated
    refused("oneOf", {"oneOf": [{"type": ["object", "null"], "properties": {"k": {"const": "a"}}, "required": ["k"]},
                                {"type": ["object", "null"], "properties": {"k": {"const": "b"}}, "required": ["k"]}]}),
    enforced("oneOf", {"$defs": {"A": {"type": "object", "properties": {"k": {"const": "a"}, "x": INT},
                                       "required": ["k", "x"]},
                                 "B": {"type": "object", "properties": {"k": {"const": "b"}, "y": STR},
                                       "required": ["k", "y"]}},
                       "oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]},
             ['{"k":"a","x":1}', '{"k":"b","y":"s"}'], ['{"k":"a","y":"s"}']),
    refused("oneOf", {"oneOf": [INT, {"type": "number"}]}),
    refused("oneOf", {"oneOf": [{"const": 1}, {"const": 1.0}]}),  # one value to JSON Schema
    refused("oneOf", {"oneOf": [{"enum": [1, 2]}, {"enum": [2.0, 3]}]}),
    enforced("oneOf", {"oneOf": [{"const": 1}, {"const": True}]}, ["1", "true"], ["2"]),
    refused("not", {"type": "integer", "not": {"const": 3}}),
    # unevaluated
    enforced("unevaluatedItems", {"type": "array", "prefixItems": [INT], "unevaluatedItems": STR}, ['[1,"x"]'],
             ["[1,2]"]),
    enforced("unevaluatedProperties", {**OBJ, "unevaluatedProperties": False}, ['{"a":1}'], ['{"c":1}']),
    enforced("unevaluatedProperties", {**OBJ, "unevaluatedProperties": STR}, ['{"a":1,"c":"s"}'], ['{"c":1}']),
    # validation: any type
    enforced("type", {"type": ["integer", "null"]}, ["1", "null"], ['"x"', "1.5"]),
    enforced("type", {"type": "boolean"}, ["true"], ["1"]),
    enforced("const", {"const": {"a": [1, "x"]}}, ['{"a":[1,"x"]}'], ['{"a":[1]}']),
    enforced("enum", {"enum": [1, "x", None, {"a": 1}]}, ["1", '"x"', "null", '{"a":1}'], ["2"]),
    enforced("enum", ABC, ['"a"'], ['"d"']),
    refused("type", {"type": "string", "enum": ["a", 1]}),
    refused("maxLength", {"type": "string", "enum": ["a", "bbb"], "maxLength": 2}),
    # validation: numbers
    enforced("multipleOf", {"type": "integer", "multipleOf": 3}, ["6"], ["7"]),
    refused("multipleOf", {"type": "number", "multipleOf": 0.5}),
    enforced("maximum", {"type": "number", "maximum": 1.5}, ["1.5", "1"], ["1.6", "3"]),
    enforced("exclusiveMaximum", {"type": "integer", "exclusiveMaximum": 3}, ["2"], ["3"]),
    enforced("minimum", {"type": "number", "minimum": -1.5}, ["-1.5"], ["-2", "-1e5"]),
    refused("minimum", {"minimum": 3}),
    enforced("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 1.5}, ["1.6"], ["1.5", "1"]),
    # xgrammar writes at most 6 decimals: a range holding no such number would compile to empty text
    enforced("minimum", {"type": "number", "minimum": 5e-7, "maximum": 1.5e-6}, ["0.000001"], ["0.000002", "0"]),
    enforced("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1.000002},
             ["1.000001"], ["1", "1.000002"]),
    refused("minimum", {"type": "object", "properties": {"lr": {"type": "number", "minimum": 1e-7, "maximum": 5e-7}}},
            "$.properties.lr"),
    refused("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1.0000001}),
    refused("minimum", {"type": ["number", "null"], "minimum": 1e-7, "maximum": 5e-7}),
    refused("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}),
    refused("minimum", {"type": "number", "minimum": 5, "maximum": 3}),
    # validation: strings
    enforced("maxLength", {"type": "string", "maxLength": 1}, ['"é"'], ['"ab"']),
    enforced("minLength", {"type": "string", "minLength": 2}, ['"ab"'], ['"é"']),
    enforced("maxLength", {"type": ["string", "null"], "maxLength": 1}, ['"👍"', "null"], ['"ab"', "1"]),
    enforced("maxLength", {"type": "string", "minLength": 1, "maxLength": 3}, ['"abc"'], ['""', '"abcd"']),
    refused("maxLength", {"maxLength": 2}),
    refused("minLength", {"type": "string", "pattern": "^a+$", "minLength": 3}),
    refused("maxLength", {"type": "string", "format": "uri", "maxLength": 12}),
    enforced("pattern", DIGITS, ['"123"'], ['"12"', '"abc"']),
    refused("pattern", {"type": "string", "pattern": "^(?=a)[a-z]+$"}),
    refused("pattern", {"type": "string", "pattern": "^(a)\\1$"}),
    refused("pattern", {"type": "string", "format": "email", "pattern": "^a"}),
    # validation: arrays
    enforced("maxItems", {"type": "array", "items": INT, "maxItems": 1}, ["[1]"], ["[1,2]"]),
    enforced("minItems", {"type": "array", "items": INT, "minItems": 2}, ["[1,2]"], ["[1]"]),
    enforced("uniqueItems", {"type": "array", "items": ABC, "uniqueItems": True},
             ["[]", '["a","c"]', '["c","b","a"]'], ['["a","a"]', '["a","b","a"]', '["a","b","c","a"]']),
    enforced("uniqueItems", {"type": "array", "items": {"enum": [1, 2, 3, 4, 5]}, "uniqueItems": True,
                             "minItems": 1, "maxItems": 3}, ["[5]", "[1,2,3]"], ["[]", "[1,1]", "[1,2,3,4]"]),
    refused("uniqueItems", {"type": "object", "properties": {"tags": {"type": "array", "items": INT,
                                                                      "uniqueItems": True}}}, "$.properties.tags"),
    refused("uniqueItems", {"type": "array", "items": {"enum": list(range(6))}, "uniqueItems": True}),
    enforced("uniqueItems", {"type": "array", "items": {"enum": [1, 1.0, 2]}, "uniqueItems": True},
             ["[1,2]"], ["[1,1]", "[1,1.0]"]),
    enforced("const", {"const": {"type": "array", "uniqueItems": True, "items": {"enum": [1]}}},
             ['{"type":"array","uniqueItems":true,"items":{"enum":[1]}}'], ["[]", "[1]"]),
    # a property named like a data keyword holds a schema like any other
    *(enforced("uniqueItems", {"type": "object", "properties": {name: {"type": "array", "items": {"enum": ["a", "b"]},
                                                                       "uniqueItems": True}}},
               [f'{{"{name}":["b","a"]}}'], [f'{{"{name}":["a","a"]}}', f'{{"{name}":["a","b","a"]}}'])
      for name in ("default", "enum", "const")),
    enforced("uniqueItems", {"type": "array", "items": ABC, "uniqueItems": False, "maxItems": 2}, ['["a","a"]'],
             ["[1]"]),
    refused("maxContains", {"type": "array", "items": ABC, "maxContains": 1}),
    refused("minContains", {"type": "array", "items": ABC, "minContains": 2}),
    # validation: objects
    enforced("maxProperties", {"type": "object", "additionalProperties": INT, "maxProperties": 1}, ['{"x":1}'],
             ['{"x":1,"y":2}']),
    enforced("minProperties", {**OBJ, "minProperties": 1}, ['{"a":1}'], ["{}"]),
    enforced("required", {**OBJ, "required": ["a"]}, ['{"a":1}'], ['{"b":1}']),
    # xgrammar makes only named properties mandatory
    refused("required", {"type": "object", "properties": {"id": INT}, "required": ["id", "name"]}),
    refused("required", {"type": "object", "required": ["default"], "additionalProperties": INT}),
    refused("dependentRequired", {**OBJ, "dependentRequired": {"a": ["b"]}}),
    # meta-data
    *(annotation(keyword, {keyword: value, **INT}, ["1", "7"]) for keyword, value in [
        ("title", "T"), ("description", "d"), ("default", 7), ("deprecated", True), ("readOnly", True),
        ("writeOnly", True), ("examples", [1])]),
    # format
    *(enforced("format", {"type": "string", "format": fmt}, [good], [bad]) for fmt, good, bad in [
        ("date", '"2024-01-02"', '"x"'), ("date-time", '"2024-01-02T03:04:05Z"', '"x"'),
        ("time", '"03:04:05Z"', '"x"'), ("duration", '"P1D"', '"x"'), ("email", '"a@b.co"', '"x"'),
        ("hostname", '"a.b"', '"-x"'), ("ipv4", '"1.2.3.4"', '"x"'), ("ipv6", '"::1"', '"x"'),
        ("uri", '"http://a.b/c"', '"x y"'), ("uri-reference", '"/a"', '"x y"'),
        ("uri-template", '"http://a/{x}"', '"{"'), ("uuid", '"123e4567-e89b-12d3-a456-426614174000"', '"x"'),
        ("json-pointer", '"/a/b"', '"a"'), ("relative-json-pointer", '"0/a"', '"a"')]),
    *(refused("format", {"type": "string", "format": fmt})
      for fmt in ("idn-email", "idn-hostname", "iri", "iri-reference", "regex")),
    annotation("format", {"type": "string", "format": "password", "maxLength": 2}, ['"ab"']),
    # content
    annotation("contentEncoding", {"type": "string", "contentEncoding": "base64"}, ['"QQ=="', '"!"']),
    annotation("contentMediaType", {"type": "string", "contentMediaType": "application/json"}, ['"x"']),
    annotation("contentSchema", {"type": "string", "contentMediaType": "application/json",
                                 "contentSchema": INT}, ['"x"']),
]


@pytest.fixture(scope="module")
def compiler():
    tokenizer = make_tokenizer()
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def accepts(compiler, params: StructuredOutputsParams, text: str) -> bool:
    matcher = compiler.matcher(params)
    return matcher.accept_string(text) and matcher.is_completed()


def test_every_keyword_has_a_case():
    covered = {case.keyword for case in CASES}
    assert KEYWORDS_2020_12 | LEGACY - {"$recursiveRef"} <= covered, KEYWORDS_2020_12 - covered
    assert set(jsonschema.Draft202012Validator.VALIDATORS) <= KEYWORDS_2020_12


@pytest.mark.parametrize("case", [case for case in CASES if case.outcome != "refused"], ids=str)
def test_enforced_and_annotation_keywords(compiler, case):
    """The grammar accepts each conforming text and rejects each violating one; the corpus
    itself is checked against a validator (formats aside: it may not know them)."""
    params = StructuredOutputsParams(json=case.schema)
    validator = jsonschema.Draft202012Validator(case.schema)
    for text in case.good:
        assert validator.is_valid(json.loads(text)), text
        assert accepts(compiler, params, text), text
    for text in case.bad:
        assert "format" in case.schema or not validator.is_valid(json.loads(text)), text
        assert not accepts(compiler, params, text), text


@pytest.mark.parametrize("case", [case for case in CASES if case.outcome == "refused"], ids=str)
def test_refused_keywords_name_keyword_and_path(case):
    with pytest.raises(ValueError, match=f"JSON schema keyword '{re.escape(case.keyword)}' at "
                                         f"{re.escape(case.path)} is not enforced|"
                                         f"keyword '{re.escape(case.keyword)}' at {re.escape(case.path)}: "):
        StructuredOutputsParams(json=case.schema)


def test_the_reported_unique_items_schema_is_enforced_through_sampling_params(compiler):
    """The issue's schema: an array of an enum of three values, no maxItems. Its distinct
    sequences are the grammar; a repeated value cannot be generated, and the array must end."""
    schema = {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True}
    params = SamplingParams(max_tokens=8, structured_outputs={"json": schema}).structured_outputs
    assert accepts(compiler, params, '["b","a"]')
    matcher = compiler.matcher(params)
    assert matcher.accept_string('["a",')
    assert not matcher.accept_string('"a"')
    with pytest.raises(ValueError, match=r"'uniqueItems' at \$ is not enforced"):
        SamplingParams(max_tokens=8, structured_outputs={"json": {**schema, "items": {"type": "string"}}})


def test_pydantic_models_of_common_shapes_pass():
    from typing import Literal, Optional

    import pydantic

    class Cited(pydantic.BaseModel):
        kind: Literal["cited"]
        ids: list[int] = pydantic.Field(max_length=3)

    class Refused(pydantic.BaseModel):
        kind: Literal["refused"]
        reason: str = pydantic.Field(max_length=80, description="why")

    class Answer(pydantic.BaseModel):
        body: Cited | Refused = pydantic.Field(discriminator="kind")
        score: float = pydantic.Field(ge=0, le=1)
        note: Optional[str] = None
        pair: tuple[int, str]
        extra: dict[str, int]

    StructuredOutputsParams(json=Answer)
    with pytest.raises(ValueError, match="'uniqueItems' at \\$.properties.tags"):
        StructuredOutputsParams(json=pydantic.create_model("Tags", tags=(set[str], ...)))


@pytest.mark.parametrize("regex, feature", [
    ("(?=a)a", "Lookahead"), ("(?!b)[ab]", "Lookahead"), ("(?<=a)b", "Lookbehind"), ("a(?<!b)", "Lookbehind"),
    ("(a)\\1", "Backreference"), ("(?<x>a)\\k<x>", "Backreference"), ("\\ba", "Word boundary"),
    ("\\p{L}", "Unicode character class"), ("(?i)a", "Group modifier"),
])
def test_unsupported_regex_features_are_named(compiler, regex, feature):
    with pytest.raises(ValueError, match=f"regex cannot be compiled: .*{feature}"):
        compiler.compile(StructuredOutputsParams(regex=regex))


@pytest.mark.parametrize("grammar, message", [
    ("root ::= foo", 'Rule "foo" is not defined'),
    ('root ::= "a', "Expect \" in string literal"),
    ('start ::= "a"', 'root rule with name "root" is not found'),
    ("start: foo", "Lark error at line 1, column 8: unknown name 'foo'"),
    ('start: "a', "unterminated string literal"),
    ('foo: "a"', "no start rule found"),
    ("start: /(?=a)a/", "Lookahead is not supported"),
])
def test_grammar_errors_are_clear_value_errors(compiler, grammar, message):
    with pytest.raises(ValueError, match=f"grammar cannot be compiled: .*{re.escape(message)}"):
        compiler.compile(StructuredOutputsParams(grammar=grammar))


@pytest.mark.parametrize("schema, text", [
    ({"type": "string", "maxLength": 10}, '"a\tb\x01"'),
    ({"type": "object", "properties": {"n": {"type": "string", "minLength": 1}}, "required": ["n"]},
     '{"n":"\x1b[0m"}'),
    ({"type": ["string", "null"], "maxLength": 3}, '"\x00"'),
    ({"type": "object", "propertyNames": {"maxLength": 3}, "additionalProperties": INT}, '{"\x00":1}'),
])
def test_length_bounded_strings_hold_no_raw_control_characters(compiler, schema, text):
    """xgrammar's own length bound admits raw control characters (not JSON); pagedrag
    narrows its character class (compiler.json_grammar)."""
    assert not accepts(compiler, StructuredOutputsParams(json=schema), text)


@pytest.mark.parametrize("letter", sorted(LITERAL_ESCAPES | set(ASCII_CLASSES)))
def test_regex_escapes_xgrammar_reads_otherwise_are_refused(letter):
    """xgrammar matches an unknown escape (\\Z, \\A, ...) as the letter itself, and reads
    \\W, \\D and \\S as ASCII classes, wider than the validator's Unicode ones."""
    with pytest.raises(ValueError, match=rf"keyword 'pattern' at \$: .*'\\{letter}'"):
        StructuredOutputsParams(json={"type": "string", "pattern": f"^a\\{letter}$"})
    with pytest.raises(ValueError, match=rf"keyword 'patternProperties' at \$: .*'\\{letter}'"):
        StructuredOutputsParams(json={"type": "object", "patternProperties": {f"[\\{letter}]": INT}})


@pytest.mark.parametrize("pattern", ["^a\\\\Z$", "^\\d\\w\\s\\.$", "^[\\x41-\\x5a]\\n\\t$"])
def test_regex_escapes_xgrammar_reads_as_the_validator_does_pass(pattern):
    check_regex(pattern, "test")


@pytest.mark.parametrize("pattern, character", [
    ('^"$', '"'), ("^\\\\$", "\\"), ("^[A-Z]:\\\\[a-z]+$", "\\"), ("^[ -~]+$", '"'), ("^\\x22$", '"'),
    ("^(a|\\t)$", "\t"), ("^\\w+\\s\\w+$", "\t"), ('^["a]$', '"'), ("^[\\x00-\\x1f]$", "\x00"),
])
def test_a_pattern_that_can_write_what_json_escapes_is_refused(compiler, pattern, character):
    """xgrammar writes a pattern's literals, positive classes and \\s into the JSON string as they
    are: a quote, a backslash or a control character there is not JSON."""
    with pytest.raises(ValueError, match=f"keyword 'pattern' at \\$: .*can match {re.escape(repr(character))}"):
        StructuredOutputsParams(json={"type": "string", "pattern": pattern})
    with pytest.raises(ValueError, match="keyword 'patternProperties'"):
        StructuredOutputsParams(json={"type": "object", "patternProperties": {pattern: INT}})


@pytest.mark.parametrize("pattern, good, bad", [
    ("^.$", ['"a"'], ['"\\""', '"\\\\"']), ("^[^a]$", ['"b"'], ['"\\""']),
    ("^[ !#-\\[\\]-~]+$", ['"a b~"'], ['"a\\"b"']),
])
def test_a_pattern_that_cannot_write_them_is_enforced(compiler, pattern, good, bad):
    """``.`` and negated classes exclude them in xgrammar (narrower than the schema: still valid)."""
    params = StructuredOutputsParams(json={"type": "string", "pattern": pattern})
    assert all(accepts(compiler, params, text) for text in good)
    assert not any(accepts(compiler, params, text) for text in bad)


def test_special_tokens_are_never_allowed_inside_constrained_output(compiler):
    """A special token's text (<|im_start|>) would be dropped by the detokenizer, so the output
    would not be the text the grammar accepted: only the stop token ends the grammar."""
    tokenizer = make_tokenizer()
    matcher = compiler.matcher(StructuredOutputsParams(json={"type": "string"}))
    assert matcher.accept_string('"ab')
    bitmask = xgrammar.allocate_token_bitmask(1, len(tokenizer))
    matcher.fill_next_token_bitmask(bitmask)
    allowed = allowed_tokens(bitmask, len(tokenizer))[0]
    special = [index for index, token in tokenizer.added_tokens_decoder.items() if token.special]
    assert special and not any(allowed[index] for index in special)
    assert allowed[tokenizer.convert_tokens_to_ids("a")]


def test_choice_keeps_characters_past_ascii_and_escapes_the_rest(compiler):
    """An emoji is its UTF-8 bytes, not two surrogate escapes; quotes, backslashes and
    control characters are exact; a lone surrogate is a ValueError."""
    choices = ["\U0001F44D yes", 'say "hi"', "a\\b", "tab\there\x01", "no"]
    params = StructuredOutputsParams(choice=choices)
    for choice in choices:
        assert accepts(compiler, params, choice), choice
    with pytest.raises(ValueError, match="lone surrogate"):
        choice_grammar(["\ud800"])
