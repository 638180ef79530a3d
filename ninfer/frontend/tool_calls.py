"""Streaming parser for Qwen XML tool calls in the content channel (ninfer-facts §5.4, serving.md "Function tools").

The model writes (the renderer puts the same newlines around each value, §5.2)

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Text outside calls streams at once; only a suffix that may begin `<tool_call>` and an open call region are held. A
call's events (started, arguments, done) come out together when its `</tool_call>` arrives: until then the region may
still turn out malformed, and a client cannot be told to forget a call it has already seen.

When the parser gives up on a region: at the first character no well-formed call could continue with (only whitespace
may surround the tags; a bad function name, an unknown tag, text between parameters or a missing `</function>` all
break it), or at finish() if the region is still open. Its `<tool_call>` then counts as ordinary text and scanning
resumes right after it, so no byte is lost and a well-formed call later in the same text is still found. Every
decision depends on the text alone, never on how it was chunked. Whitespace around calls is ordinary text too;
trimming a final content is left to the protocol layer.
"""

from __future__ import annotations

import enum
import json
import math
import re
import secrets
from collections.abc import Callable, Iterable
from typing import Any

import attrs

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"

_WHITESPACE = re.compile(r"[ \t\r\n]*")
_NAME_CHARS = re.compile(r"[A-Za-z0-9_-]*")  # OpenAI's function-name alphabet, as the reference parser checks
_KEY_CHARS = re.compile(r"[^<>\n]*")
_COMPACT_AFTER = 1024  # consumed characters a region's working string may keep before they move out


def new_call_id() -> str:
    """A fresh id in the reference's `call_%016llx` form."""
    return f"call_{secrets.randbits(64):016x}"


@attrs.frozen
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]
    arguments_json: str  # compact JSON of `arguments`, what the wire protocols carry
    markup: str  # the exact text the call was parsed from, `<tool_call>` through `</tool_call>`


# Events are plain (unfrozen) records: one is made per streamed piece, and frozen attrs classes cost twice as much
# to build.
@attrs.define
class TextDelta:
    text: str


@attrs.define
class ToolCallStarted:
    index: int
    id: str
    name: str


@attrs.define
class ToolCallArgumentsDelta:
    index: int
    delta: str


@attrs.define
class ToolCallDone:
    index: int
    call: ToolCall


ToolCallEvent = TextDelta | ToolCallStarted | ToolCallArgumentsDelta | ToolCallDone


# --- argument typing ------------------------------------------------------------------------------------------------


def _schema_types(schema: Any) -> frozenset[str]:
    """JSON Schema type names a parameter accepts; empty when the schema does not say (anything goes)."""
    if not isinstance(schema, dict):
        return frozenset()
    declared = schema.get("type")
    if isinstance(declared, str):
        return frozenset({declared})
    if isinstance(declared, list):
        return frozenset(t for t in declared if isinstance(t, str))
    for union in ("anyOf", "oneOf"):
        if isinstance(schema.get(union), list):
            members = [_schema_types(member) for member in schema[union]]
            return frozenset().union(*members) if all(members) else frozenset()
    return frozenset()


def _json_types(value: Any) -> frozenset[str]:
    """Schema type names `value` satisfies."""
    if isinstance(value, bool):
        return frozenset({"boolean"})
    if isinstance(value, int):
        return frozenset({"integer", "number"})
    if isinstance(value, float):
        return frozenset({"number", "integer"} if value.is_integer() else {"number"})
    if value is None:
        return frozenset({"null"})
    if isinstance(value, dict):
        return frozenset({"object"})
    if isinstance(value, list):
        return frozenset({"array"})
    return frozenset({"string"})


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 would serialize as Infinity, which is not JSON
        raise ValueError(f"{text} overflows a double")
    return value


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # Python's json accepts NaN and Infinity; clients would not


_STRICT_JSON = json.JSONDecoder(parse_float=_finite_float, parse_constant=_not_json)


def _typed_value(text: str, types: frozenset[str]) -> Any:
    """A parameter's value: strings are written raw, everything else as JSON (the template's own rule, §5.2)."""
    if types == {"string"}:
        return text
    try:
        value = _STRICT_JSON.decode(text)
    except ValueError:
        return text
    # A schema that allows strings keeps the raw text unless it parses as one of the other allowed types.
    if "string" in types and (isinstance(value, str) or types.isdisjoint(_json_types(value))):
        return text
    return value


class ParameterTypes:
    """Each tool's parameter types from the request's tool list (OpenAI chat, Responses or Anthropic shapes)."""

    def __init__(self, tools: Iterable[dict[str, Any]] | None) -> None:
        self._types: dict[str, dict[str, frozenset[str]]] = {}
        for tool in tools or ():
            # Typing is best effort: a tool the protocol layer let through without a usable schema is untyped.
            function = tool.get("function", tool) if isinstance(tool, dict) else None
            if not isinstance(function, dict):
                continue
            schema = function.get("parameters", function.get("input_schema"))
            properties = schema.get("properties") if isinstance(schema, dict) else None
            if isinstance(function.get("name"), str) and isinstance(properties, dict):
                self._types[function["name"]] = {key: _schema_types(s) for key, s in properties.items()}

    def convert(self, tool: str, key: str, text: str) -> Any:
        """Typed by the schema when it declares the parameter, else JSON if the text parses, else the text."""
        return _typed_value(text, self._types.get(tool, {}).get(key, frozenset()))


# --- one call region ------------------------------------------------------------------------------------------------


class _Outcome(enum.Enum):
    INCOMPLETE = "incomplete"  # a well-formed call could still follow: wait for more text
    COMPLETE = "complete"
    MALFORMED = "malformed"


def _strip_one_newline(value: str) -> str:
    """Undo just the newlines the renderer writes after `>` and before `</parameter>`; other whitespace is data."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


class _CallRegion:
    """One region from `<tool_call>` on, parsed as its text arrives; each step resumes where the last one stopped.

    The region's text is `"".join(self._consumed) + self._text[self._start:]`. Whatever the steps have consumed leaves
    the working string when more text arrives, so appending stays cheap however long the region grows (a file's
    contents as an argument), and a region inside one big chunk is parsed in place without copying.
    """

    def __init__(self, text: str, start: int, max_name_length: int) -> None:
        self._text = text  # text[start:] begins with `<tool_call>`
        self._start = start
        self._consumed: list[str] = []
        self._pos = start + len(TOOL_CALL_OPEN)
        self._scan_from = self._pos  # how far a name, key or value has been searched already (avoids rescans)
        self._key = ""
        self._value_from = 0
        self._value_consumed: list[str] = []  # the current value's text that has left the working string
        self._step: Callable[[], _Outcome | None] = self._function_open
        self._max_name_length = max_name_length
        self.name = ""
        self.parameters: list[tuple[str, str]] = []
        self.end = 0  # once complete: the offset in the working string just past `</tool_call>`

    def feed(self, text: str) -> None:
        cut = self._pos
        if cut < _COMPACT_AFTER:  # copying a short working string is cheaper than moving pieces out of it
            self._text += text
            return
        self._consumed.append(self._text[self._start : cut])
        if self._step == self._parameter_value:
            self._value_consumed.append(self._text[self._value_from : cut])
            self._value_from = 0
        self._text = self._text[cut:] + text
        self._start, self._pos, self._scan_from = 0, 0, self._scan_from - cut

    @property
    def markup(self) -> str:
        return "".join(self._consumed) + self._text[self._start : self.end]

    def rest(self) -> tuple[str, int]:
        """Where the text after a complete call continues: (string, offset)."""
        return self._text, self.end

    def after_open_tag(self) -> tuple[str, int]:
        """Where the text after the opening tag continues, to be scanned afresh: (string, offset)."""
        if not self._consumed:
            return self._text, self._start + len(TOOL_CALL_OPEN)
        return "".join(self._consumed) + self._text[self._start :], len(TOOL_CALL_OPEN)

    def advance(self) -> _Outcome:
        while True:
            outcome = self._step()
            if outcome is not None:
                return outcome

    def _goto(self, step: Callable[[], _Outcome | None], pos: int) -> None:
        self._step, self._pos, self._scan_from = step, pos, pos

    def _skip_whitespace(self) -> None:
        self._pos = _WHITESPACE.match(self._text, self._pos).end()

    def _expect(self, *choices: tuple[str, Callable[[], _Outcome | None]]) -> _Outcome | None:
        """Consume whichever literal comes next and go to its step; wait while the text is a prefix of one."""
        for literal, then in choices:
            if self._text.startswith(literal, self._pos):
                self._goto(then, self._pos + len(literal))
                return None
        for literal, _ in choices:
            rest = self._text[self._pos : self._pos + len(literal)]
            if len(rest) < len(literal) and literal.startswith(rest):
                return _Outcome.INCOMPLETE
        return _Outcome.MALFORMED

    def _tag_argument(self, chars: re.Pattern, max_length: int | None) -> str | _Outcome:
        """The NAME / KEY of `<function=NAME>` / `<parameter=KEY>` and its closing `>`, consumed."""
        end = chars.match(self._text, self._scan_from).end()
        if max_length is not None and end - self._pos > max_length:
            return _Outcome.MALFORMED
        if end == len(self._text):
            self._scan_from = end
            return _Outcome.INCOMPLETE
        if self._text[end] != ">" or end == self._pos:
            return _Outcome.MALFORMED
        argument = self._text[self._pos : end]
        self._pos = end + 1
        return argument

    def _function_open(self) -> _Outcome | None:
        self._skip_whitespace()
        return self._expect((FUNCTION_OPEN, self._function_name))

    def _function_name(self) -> _Outcome | None:
        name = self._tag_argument(_NAME_CHARS, self._max_name_length)
        if isinstance(name, _Outcome):
            return name
        self.name = name
        self._goto(self._body, self._pos)
        return None

    def _body(self) -> _Outcome | None:
        """Between tags: the next parameter or `</function>`."""
        self._skip_whitespace()
        return self._expect((PARAMETER_OPEN, self._parameter_key), (FUNCTION_CLOSE, self._call_close))

    def _parameter_key(self) -> _Outcome | None:
        key = self._tag_argument(_KEY_CHARS, None)
        if isinstance(key, _Outcome):
            return key
        self._key, self._value_from = key, self._pos
        self._goto(self._parameter_value, self._pos)
        return None

    def _parameter_value(self) -> _Outcome | None:
        # A value is literal text up to the first `</parameter>`: it may hold tags, even `</tool_call>`.
        at = self._text.find(PARAMETER_CLOSE, self._scan_from)
        if at < 0:
            # All but a possible start of `</parameter>` is value for sure: consumed.
            self._pos = self._scan_from = max(self._pos, len(self._text) - len(PARAMETER_CLOSE) + 1)
            return _Outcome.INCOMPLETE
        value = "".join(self._value_consumed) + self._text[self._value_from : at]
        self._value_consumed.clear()
        self.parameters.append((self._key, _strip_one_newline(value)))
        self._goto(self._body, at + len(PARAMETER_CLOSE))
        return None

    def _call_close(self) -> _Outcome | None:
        self._skip_whitespace()
        return self._expect((TOOL_CALL_CLOSE, self._complete))

    def _complete(self) -> _Outcome:
        self.end = self._pos
        return _Outcome.COMPLETE


# --- the parser -----------------------------------------------------------------------------------------------------


def _open_tag_prefix(text: str, pos: int) -> int:
    """Length of the longest suffix of `text[pos:]` (which holds no whole `<tool_call>`) that may begin one.

    Such a suffix starts with the tag's only `<`, so only the last `<` in reach can begin it.
    """
    at = text.rfind("<", max(pos, len(text) - len(TOOL_CALL_OPEN) + 1))
    return len(text) - at if at >= 0 and TOOL_CALL_OPEN.startswith(text[at:]) else 0


def _append_text(events: list[ToolCallEvent], text: str) -> None:
    """Adjacent text within one answer becomes one delta."""
    if not text:
        return
    if events and isinstance(events[-1], TextDelta):
        events[-1] = TextDelta(events[-1].text + text)
    else:
        events.append(TextDelta(text))


class ToolCallParser:
    """Content text in (any chunking), text deltas and tool-call events out; `calls` collects the finished calls."""

    def __init__(
        self,
        tools: Iterable[dict[str, Any]] | None = None,
        *,
        new_id: Callable[[], str] = new_call_id,
        max_name_length: int = 64,  # the reference's limit for OpenAI; its Anthropic endpoint allows 128
    ) -> None:
        self._types = ParameterTypes(tools)
        self._new_id = new_id
        self._max_name_length = max_name_length
        self._held = ""  # outside a call: a suffix that may begin `<tool_call>`
        self._region: _CallRegion | None = None
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[ToolCallEvent]:
        if self._region is None and not self._held and "<" not in text:
            return [TextDelta(text)] if text else []  # most pieces: plain text, nothing to hold
        events: list[ToolCallEvent] = []
        if self._region is None:
            self._scan(self._held + text, 0, events, final=False)
        else:
            self._region.feed(text)
            outcome = self._region.advance()
            if outcome is not _Outcome.INCOMPLETE:
                self._scan(*self._close_region(outcome, events), events, final=False)
        return events

    def finish(self) -> list[ToolCallEvent]:
        """End of content: whatever is held comes back as text unless it completes a call."""
        events: list[ToolCallEvent] = []
        if self._region is not None:  # still open at the end: not a call
            self._scan(*self._close_region(_Outcome.INCOMPLETE, events), events, final=True)
        else:
            self._scan(self._held, 0, events, final=True)
        return events

    def _scan(self, text: str, pos: int, events: list[ToolCallEvent], *, final: bool) -> None:
        """Scan `text[pos:]` outside calls, on through every region it opens."""
        while True:
            at = text.find(TOOL_CALL_OPEN, pos)
            if at < 0:
                keep = 0 if final else _open_tag_prefix(text, pos)
                _append_text(events, text[pos : len(text) - keep])
                self._held = text[len(text) - keep :]
                return
            _append_text(events, text[pos:at])
            self._held = ""
            self._region = _CallRegion(text, at, self._max_name_length)
            outcome = self._region.advance()
            if outcome is _Outcome.INCOMPLETE and not final:
                return
            text, pos = self._close_region(outcome, events)

    def _close_region(self, outcome: _Outcome, events: list[ToolCallEvent]) -> tuple[str, int]:
        """Emit the call the region formed, or else its opening tag as text; returns where scanning resumes."""
        region, self._region = self._region, None
        if outcome is _Outcome.COMPLETE:
            self._emit_call(region, events)
            return region.rest()
        # Not a call after all: what followed the opening tag is scanned afresh.
        _append_text(events, TOOL_CALL_OPEN)
        return region.after_open_tag()

    def _emit_call(self, region: _CallRegion, events: list[ToolCallEvent]) -> None:
        arguments = {key: self._types.convert(region.name, key, value) for key, value in region.parameters}
        call = ToolCall(
            id=self._new_id(),
            name=region.name,
            arguments=arguments,
            arguments_json=json.dumps(arguments, ensure_ascii=False, separators=(",", ":")),
            markup=region.markup,
        )
        index = len(self.calls)
        self.calls.append(call)
        events += [ToolCallStarted(index, call.id, call.name), ToolCallArgumentsDelta(index, call.arguments_json),
                   ToolCallDone(index, call)]


def parse_tool_calls(
    text: str, tools: Iterable[dict[str, Any]] | None = None, **options: Any
) -> tuple[str, list[ToolCall]]:
    """One-shot parse of a whole content: (the text outside calls, the calls)."""
    parser = ToolCallParser(tools, **options)
    events = parser.feed(text) + parser.finish()
    return "".join(e.text for e in events if isinstance(e, TextDelta)), parser.calls
