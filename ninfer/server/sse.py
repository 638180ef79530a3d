"""Server-sent event framing on the wire: `event: NAME` (when named), one `data:` line per line of data, and a
blank line. SSE responses are never cached or buffered by proxies."""

from __future__ import annotations

import json
import re
from typing import Any

from ninfer.server.context import SseEvent

LINE_BREAK = re.compile(r"\r\n|\r|\n")  # SSE's three line endings
SSE_HEADERS = (("content-type", "text/event-stream; charset=utf-8"), ("cache-control", "no-cache"),
               ("x-accel-buffering", "no"))


def frame(event: SseEvent) -> bytes:
    lines = [f"event: {event.event}"] if event.event is not None else []
    # A line break inside data would end the field early: each line goes in its own data field, which the
    # client joins back with "\n".
    lines += [f"data: {line}" for line in LINE_BREAK.split(event.data)]
    return ("\n".join(lines) + "\n\n").encode("utf-8")


def json_event(payload: Any, event: str | None = None) -> SseEvent:
    """An event whose data is compact JSON (one line: JSON escapes line breaks inside strings)."""
    return SseEvent(json.dumps(payload, ensure_ascii=False, separators=(",", ":")), event)
