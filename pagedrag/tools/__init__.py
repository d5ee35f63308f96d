"""OpenAI-style tool calling, independent of any model: checking a request's tools
(``plan_tools``), enforcing a forced choice with a grammar and reading calls back
(``ToolPlan``), reading calls out of free text per model family (``ToolParser``,
``parser_for``, ``PARSERS``), and getting tools and past calls into a chat template
(``prepare_conversation``, ``template_supports_tools``)."""

from pagedrag.tools.parsers import PARSERS, ToolParser, parser_for
from pagedrag.tools.plan import ToolCall, ToolPlan, plan_tools
from pagedrag.tools.prompting import prepare_conversation, template_supports_tools
from pagedrag.tools.stream import ToolCallSplitter, whole_choice

__all__ = ["PARSERS", "ToolCall", "ToolParser", "ToolPlan", "parser_for", "plan_tools", "prepare_conversation",
           "template_supports_tools", "ToolCallSplitter", "whole_choice"]
