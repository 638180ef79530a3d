"""The runner's captured step graphs, by step shape, with a bound on how many it keeps.

Decode steps come in many shapes (a verify round's rows depend on how many lanes draft, a short prefill chunk's on
its length, the MTP head's and the proposals' on the rows they serve), and each captured graph holds device memory
(its nodes and their parameters). The ordinary decode graph of every batch size is captured at startup and kept
(pinned: the KV sizing counts them); every other shape is kept most recently used first, at most `spare` of them,
and capturing one more frees the least recently used (it is captured again if its shape comes back). So the device
memory of graphs stays bounded whatever mix of shapes a long run sees.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

SPARE_GRAPHS = 96  # shapes kept beyond the pinned decode graphs: every short-prefill length (up to 64) and more


class GraphCache:
    def __init__(self, spare: int = SPARE_GRAPHS) -> None:
        if spare < 0:
            raise ValueError(f"spare graphs must be >= 0, got {spare}")
        self.spare = spare
        self.evictions = 0  # graphs freed to make room (a returning shape is captured again)
        self._pinned: dict[tuple, Any] = {}
        self._recent: OrderedDict[tuple, Any] = OrderedDict()

    def __contains__(self, key: tuple) -> bool:
        return key in self._pinned or key in self._recent

    def __len__(self) -> int:
        return len(self._pinned) + len(self._recent)

    def __iter__(self):
        """The shapes held: pinned ones, then the others from least to most recently used."""
        yield from self._pinned
        yield from self._recent

    def get(self, key: tuple) -> Any:
        """The graph of this shape, or None; a kept (unpinned) one becomes the most recently used."""
        graph = self._pinned.get(key)
        if graph is None and key in self._recent:
            self._recent.move_to_end(key)
            graph = self._recent[key]
        return graph

    def add(self, key: tuple, graph: Any, *, pinned: bool = False) -> None:
        if pinned:
            self._pinned[key] = graph
            return
        self._recent[key] = graph
        while len(self._recent) > self.spare:
            _, oldest = self._recent.popitem(last=False)
            oldest.close()
            self.evictions += 1

    def close(self) -> None:
        """Free every graph."""
        for graph in (*self._pinned.values(), *self._recent.values()):
            graph.close()
        self._pinned.clear()
        self._recent.clear()
