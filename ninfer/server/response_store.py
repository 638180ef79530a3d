"""The local Response store: stored Responses by id, least recently used evicted first, bounded by a record count
(--response-store-max-records) and a byte budget (--response-store-max-mib) (serving.md "Local response state").

A stored Response keeps its response object, its normalized input Items, its resolved preserve_thinking, and its
conversation: the Items a continuation (previous_response_id) replays, instructions excluded. Conversations are
chains of immutable segments, one per Response (its input Items, then its output Items) linked to the parent's
segment, so a long chain stores each turn once. A segment lives as long as a stored Response or a live child segment
holds it: deleting or evicting a Response ends its public retrieval, while the conversations of its descendants stay
complete.

Bytes are counted as compact JSON: each stored Response its response object, each live segment its Items once. A
Response whose own bytes plus its whole conversation exceed the budget is refused (ResponseStoreFull) rather than
stored and evicted at once.

The store belongs to the server's trio thread; nothing here locks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import attrs

from ninfer.protocol.common import to_json
from ninfer.protocol.openai_responses import CONVERTER, InputItem, OutputItem, Response

Item = InputItem | OutputItem


class ResponseStoreFull(Exception):
    """One Response with its conversation is larger than the whole store (HTTP response_store_capacity_exceeded)."""


def json_bytes(value: Any) -> int:
    """The size of a protocol object (or a tuple of them) as compact JSON."""
    return len(to_json(CONVERTER, value).encode("utf-8"))


@attrs.define(eq=False)
class _Segment:
    """One Response's Items, after its parent's. `holders`: the stored Response that owns it (if still stored) plus
    its live child segments; at zero it is released, and so is its hold on the parent."""

    parent: _Segment | None
    items: tuple[Item, ...]
    nbytes: int
    holders: int = 0

    def chain_bytes(self) -> int:
        segment: _Segment | None = self
        total = 0
        while segment is not None:
            total += segment.nbytes
            segment = segment.parent
        return total


@attrs.frozen(eq=False)
class StoredResponse:
    response: Response
    preserve_thinking: bool  # resolved for this Response; a continuation that omits the field inherits it
    _segment: _Segment
    _input_count: int
    nbytes: int  # the response object's JSON

    @property
    def input_items(self) -> tuple[InputItem, ...]:
        """The normalized Items supplied to this Response's request."""
        return self._segment.items[: self._input_count]

    @property
    def conversation(self) -> tuple[Item, ...]:
        """Every Item of the chain through this Response's output, oldest first."""
        segments = []
        segment: _Segment | None = self._segment
        while segment is not None:
            segments.append(segment.items)
            segment = segment.parent
        return tuple(item for items in reversed(segments) for item in items)


class ResponseStore:
    def __init__(self, max_records: int, max_bytes: int) -> None:
        self.max_records, self.max_bytes = max_records, max_bytes
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self.nbytes = 0  # stored response objects plus live segments

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._records

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored Response, now the most recently used; None when it was never stored, evicted or deleted."""
        stored = self._records.get(response_id)
        if stored is not None:
            self._records.move_to_end(response_id)
        return stored

    def check_fits(self, input_items: tuple[InputItem, ...], parent: StoredResponse | None) -> None:
        """Refuse early a request whose input alone would make its Response too large to store."""
        self._check(json_bytes(input_items) + (parent._segment.chain_bytes() if parent else 0))

    def put(self, response: Response, input_items: tuple[InputItem, ...], *, parent: StoredResponse | None,
            preserve_thinking: bool) -> StoredResponse:
        """Store a terminal Response, evicting the least recently used others as the bounds require."""
        items = input_items + response.output
        segment = _Segment(parent._segment if parent else None, items, json_bytes(items))
        stored = StoredResponse(response, preserve_thinking, segment, len(input_items), json_bytes(response))
        self._check(stored.nbytes + segment.chain_bytes())
        self._hold(segment)
        self._records[response.id] = stored
        self.nbytes += stored.nbytes
        while len(self._records) > 1 and (len(self._records) > self.max_records or self.nbytes > self.max_bytes):
            self._remove(next(iter(self._records)))
        return stored

    def delete(self, response_id: str) -> bool:
        """End public retrieval of a Response (descendants keep their conversations); False if it is not stored."""
        if response_id not in self._records:
            return False
        self._remove(response_id)
        return True

    def _check(self, nbytes: int) -> None:
        if nbytes > self.max_bytes:
            raise ResponseStoreFull(f"the response and its conversation take {nbytes} bytes, more than the "
                                    f"response store's {self.max_bytes} (--response-store-max-mib)")

    def _remove(self, response_id: str) -> None:
        stored = self._records.pop(response_id)
        self.nbytes -= stored.nbytes
        self._release(stored._segment)

    def _hold(self, segment: _Segment | None) -> None:
        while segment is not None:
            segment.holders += 1
            if segment.holders > 1:  # already live, and so is everything before it
                return
            self.nbytes += segment.nbytes
            segment = segment.parent

    def _release(self, segment: _Segment | None) -> None:
        while segment is not None:
            segment.holders -= 1
            if segment.holders > 0:
                return
            self.nbytes -= segment.nbytes
            segment = segment.parent
