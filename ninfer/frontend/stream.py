"""One request's output as the protocols stream it: the output decoder's channels, tool calls parsed from content.

Only the content channel goes through the tool-call parser: a `<tool_call>` written while thinking stays reasoning
text (the template asks for reasoning before a call, never a call inside it).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from ninfer.frontend.output import FinishReason, OutputDecoder
from ninfer.frontend.tool_calls import TextDelta, ToolCall, ToolCallEvent, ToolCallParser


@attrs.define
class StreamDelta:
    reasoning: str = ""
    content: list[ToolCallEvent] = attrs.Factory(list)  # text and tool-call events, in order; all after `reasoning`
    finish: FinishReason | None = None


class ResponseStream:
    def __init__(self, decoder: OutputDecoder, tool_parser: ToolCallParser | None = None) -> None:
        self.decoder = decoder  # usage counts and the finish reason live there
        self._tool_parser = tool_parser

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self._tool_parser.calls if self._tool_parser is not None else []

    def push(self, token_ids: Sequence[int]) -> tuple[StreamDelta, int]:
        """One round of accepted tokens; returns the delta and how many of them the output took (see push_many)."""
        delta, accepted = self.decoder.push_many(token_ids)
        return self._events(delta.reasoning, delta.content, delta.finish), accepted

    def finish(self, reason: FinishReason = FinishReason.LENGTH) -> StreamDelta:
        """End by the engine's limit (a no-op after a stop): everything held is flushed."""
        delta = self.decoder.finish(reason)
        return self._events(delta.reasoning, delta.content, delta.finish)

    def _events(self, reasoning: str, content: str, finish: FinishReason | None) -> StreamDelta:
        if self._tool_parser is None:
            return StreamDelta(reasoning, [TextDelta(content)] if content else [], finish)
        events = self._tool_parser.feed(content)
        if finish is not None:
            events += self._tool_parser.finish()
        return StreamDelta(reasoning, events, finish)
