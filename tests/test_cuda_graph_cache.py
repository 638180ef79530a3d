"""GraphCache: startup's decode graphs stay, other shapes are kept most recently used first up to a bound."""

from __future__ import annotations

import pytest

from ninfer.backends.cuda.graph_cache import GraphCache


class FakeGraph:
    def __init__(self, name):
        self.name, self.closed = name, False

    def close(self):
        self.closed = True


def test_pinned_graphs_stay_and_the_least_recently_used_goes_first():
    cache = GraphCache(spare=2)
    decode = FakeGraph("decode")
    cache.add(("decode", 1), decode, pinned=True)
    a, b, c = FakeGraph("a"), FakeGraph("b"), FakeGraph("c")
    cache.add(("a",), a)
    cache.add(("b",), b)
    assert cache.get(("a",)) is a  # a becomes the most recently used: b goes next
    cache.add(("c",), c)
    assert b.closed and not a.closed and not c.closed and not decode.closed
    assert cache.get(("b",)) is None and ("b",) not in cache
    assert list(cache) == [("decode", 1), ("a",), ("c",)]
    assert cache.evictions == 1 and len(cache) == 3
    cache.close()
    assert a.closed and c.closed and decode.closed and len(cache) == 0


def test_no_spare_room_keeps_only_the_pinned_graphs():
    cache = GraphCache(spare=0)
    graph = FakeGraph("x")
    cache.add(("x",), graph)
    assert graph.closed and ("x",) not in cache
    with pytest.raises(ValueError, match="spare graphs"):
        GraphCache(spare=-1)
