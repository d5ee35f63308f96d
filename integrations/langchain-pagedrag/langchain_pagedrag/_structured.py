"""The parts of ``ChatPagedRAG.with_structured_output``: the constraint a schema becomes,
the parser that reads a reply back into the schema's type, and the ``include_raw`` form."""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass

METHODS = ("json_schema", "function_calling", "json_mode")


def is_pydantic_class(schema: Any) -> bool:
    """A pydantic model class (v1 or v2): parsed into instances, not dicts."""
    return isinstance(schema, type) and is_basemodel_subclass(schema)


def json_schema_format(schema: Any, strict: bool | None) -> dict[str, Any]:
    """OpenAI's ``response_format`` for a pydantic class, TypedDict, JSON schema or OpenAI
    function/tool (what convert_to_json_schema takes): the schema as LangChain writes it
    for tools, so both methods constrain a reply alike."""
    json_schema = convert_to_json_schema(schema, strict=strict)
    return {"type": "json_schema", "json_schema": {"name": json_schema["title"], "schema": json_schema}}


def content_parser(schema: Any) -> Runnable:
    """A reply's content (JSON text) as the schema's type: a pydantic instance, else a dict
    (also with no schema, as JSON mode allows)."""
    return PydanticOutputParser(pydantic_object=schema) if is_pydantic_class(schema) else JsonOutputParser()


def tool_parser(schema: Any, name: str) -> Runnable:
    """A reply's first call of the tool ``name`` (the schema's) as the schema's type; None
    when the reply made none."""
    if is_pydantic_class(schema):
        return PydanticToolsParser(tools=[schema], first_tool_only=True)
    return JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)


def with_raw(llm: Runnable, parser: Runnable) -> Runnable:
    """``{"raw", "parsed", "parsing_error"}`` per input: the model's message, what the parser
    made of it (None when it failed) and the parser's exception (None when it did not)."""
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    failed = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")
