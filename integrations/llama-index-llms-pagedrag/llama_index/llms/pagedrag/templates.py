"""QA and refine templates in the canonical layout: instructions, then context, then query.

LlamaIndex's own chat templates (CHAT_TEXT_QA_PROMPT, CHAT_REFINE_PROMPT, which it picks
for chat models such as PagedRAG) already put the context before the query; its
completion-style refine template (DEFAULT_REFINE_PROMPT) starts with the query, so every
refine call misses the cache from its first tokens. These templates keep the layout the
same for both steps and both kinds of model: a system message that never changes, the
retrieved context, then what changes with every request (the query, and for refine the
existing answer) last. ``canonical_query_engine_kwargs`` pairs them with the canonical
node order.
"""

from __future__ import annotations

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.prompts import ChatPromptTemplate
from llama_index.core.prompts.prompt_type import PromptType

from pagedrag.rag.prompts import RAG_SYSTEM_PROMPT, canonical_template_messages

REFINE_SYSTEM_PROMPT = ("You are an expert Q&A system that refines an existing answer. Rewrite the existing "
                        "answer using the new context given before the question, or repeat it unchanged if the "
                        "new context is not useful. Never refer to the context or the existing answer directly.")


def _chat_template(system_prompt: str, context: str, query: str, prompt_type: PromptType) -> ChatPromptTemplate:
    messages = [ChatMessage(role=m["role"], content=m["content"])
                for m in canonical_template_messages(system_prompt, context, query)]
    return ChatPromptTemplate(message_templates=messages, prompt_type=prompt_type)


PAGEDRAG_QA_TEMPLATE = _chat_template(RAG_SYSTEM_PROMPT, "Context information:\n{context_str}",
                                      "Question: {query_str}\nAnswer:", PromptType.QUESTION_ANSWER)
PAGEDRAG_REFINE_TEMPLATE = _chat_template(
    REFINE_SYSTEM_PROMPT, "New context:\n{context_msg}",
    "Question: {query_str}\nExisting answer: {existing_answer}\nRefined answer:", PromptType.REFINE)
