"""One streamed choice of a chat with tools, split into content to show and tool calls.

What may be shown at once: without tools (or with tool_choice "none") everything; with
"auto", everything but a tail that may begin a call (the parser's ``holdback``); with
"required" or a named function nothing, since the whole output is the calls' JSON. When
the choice ends, its whole text is parsed once (``ToolPlan.parse``) and the calls come out.
"""

from __future__ import annotations

from pagedrag.tools.parsers import ToolParser
from pagedrag.tools.plan import ToolCall, ToolPlan


class ToolCallSplitter:
    """Invariants: content once released is never taken back, and is a prefix of what the
    whole text shows as content; calls come out once, with the finishing piece."""

    def __init__(self, plan: ToolPlan | None, parser: ToolParser):
        self.plan = plan
        self.parser = parser
        self.text = ""  # the choice's whole text so far
        self.released = 0  # characters of self.text shown as content

    @property
    def reads_calls(self) -> bool:
        return self.plan is not None and self.plan.choice != "none"

    def feed(self, new_text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """(content to show now, the calls: non-empty only when ``finished`` and the model
        made calls)."""
        self.text += new_text
        if not self.reads_calls:
            return self._release(len(self.text)), []
        if not finished:
            if self.plan.choice != "auto":
                return "", []
            return self._release(len(self.text) - self.parser.holdback(self.text)), []
        content, calls = self.plan.parse(self.text, self.parser)
        if not calls:
            return self._release(len(self.text)), []
        return self._rest_of(content or ""), calls

    def _release(self, upto: int) -> str:
        if upto <= self.released:
            return ""
        piece, self.released = self.text[self.released:upto], upto
        return piece

    def _rest_of(self, content: str) -> str:
        """What of the parsed content was not shown yet (the shown part is its beginning,
        up to the whitespace the parser strips)."""
        shown = self.text[:self.released].strip()
        return content[len(shown):] if content.startswith(shown) else ""


def whole_choice(plan: ToolPlan | None, parser: ToolParser, text: str,
                 finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
    """A finished choice as (content, calls, finish_reason): "tool_calls" when it made calls."""
    if plan is None or plan.choice == "none":
        return text, [], finish_reason
    content, calls = plan.parse(text, parser)
    return content, calls, "tool_calls" if calls else finish_reason
