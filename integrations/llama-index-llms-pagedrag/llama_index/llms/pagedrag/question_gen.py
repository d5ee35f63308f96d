"""StructuredQuestionGenerator: SubQuestionQueryEngine's sub-questions by structured prediction.

``SubQuestionQueryEngine.from_defaults`` wants llama-index-question-gen-openai, whose
releases require llama-index-core < 0.13, and LlamaIndex's text generator
(LLMQuestionGenerator) depends on a model writing JSON markdown unprompted. This one asks
the LLM's ``structured_predict`` for the list in a schema built from the tools at hand, so
with a function-calling PagedRAG the grammar-forced call is always a valid list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from llama_index.core.bridge.pydantic import BaseModel, Field, create_model
from llama_index.core.llms.llm import LLM
from llama_index.core.prompts import BasePromptTemplate, PromptTemplate
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.question_gen.prompts import build_tools_text
from llama_index.core.question_gen.types import BaseQuestionGenerator, SubQuestion
from llama_index.core.schema import QueryBundle
from llama_index.core.settings import Settings
from llama_index.core.tools.types import ToolMetadata

SUB_QUESTION_PROMPT = PromptTemplate(
    "Break the user's question into simple sub-questions. Each sub-question is answered by one of these tools "
    "(name: description):\n{tools_str}\n\nUser question: {query_str}")


class StructuredQuestionGenerator(BaseQuestionGenerator):
    """Sub-questions through ``llm.structured_predict`` (Settings.llm when no ``llm``).

    Invariants: the schema the LLM fills allows only the given tools' names, 1 to
    ``max_questions`` sub-questions and at most ``max_chars`` characters each, so a
    schema-valid output always routes to a real tool and ends in a bounded number of tokens.
    """

    def __init__(self, llm: LLM | None = None, prompt: BasePromptTemplate = SUB_QUESTION_PROMPT,
                 max_questions: int = 3, max_chars: int = 200) -> None:
        self._llm = llm or Settings.llm
        self._prompt = prompt
        self._max_questions = max_questions
        self._max_chars = max_chars

    def _get_prompts(self) -> PromptDictType:
        return {"question_gen_prompt": self._prompt}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        if "question_gen_prompt" in prompts:
            self._prompt = prompts["question_gen_prompt"]

    def generate(self, tools: Sequence[ToolMetadata], query: QueryBundle) -> list[SubQuestion]:
        output_cls, prompt_args = self._request(tools, query)
        return _sub_questions(self._llm.structured_predict(output_cls, self._prompt, **prompt_args))

    async def agenerate(self, tools: Sequence[ToolMetadata], query: QueryBundle) -> list[SubQuestion]:
        output_cls, prompt_args = self._request(tools, query)
        return _sub_questions(await self._llm.astructured_predict(output_cls, self._prompt, **prompt_args))

    def _request(self, tools: Sequence[ToolMetadata], query: QueryBundle) -> tuple[type[BaseModel], dict[str, str]]:
        """The output class and the prompt's variables of one generation."""
        return self._output_cls(tools), {"tools_str": build_tools_text(tools), "query_str": query.query_str}

    def _output_cls(self, tools: Sequence[ToolMetadata]) -> type[BaseModel]:
        """The bounded list of sub-questions over these tools (see the class's invariants)."""
        question = create_model(
            "SubQuestion",
            sub_question=(str, Field(max_length=self._max_chars, description="A question one tool answers")),
            tool_name=(Literal[tuple(tool.name for tool in tools)], Field(description="The tool that answers it")))
        return create_model("SubQuestionList", __doc__="Sub-questions that together answer the user's question.",
                            items=(list[question], Field(min_length=1, max_length=self._max_questions)))


def _sub_questions(output: BaseModel) -> list[SubQuestion]:
    return [SubQuestion(sub_question=item.sub_question, tool_name=item.tool_name) for item in output.items]
