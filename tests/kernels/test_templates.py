"""`unroll` writes out the loops kernel templates mark, literally, and nothing else."""

from __future__ import annotations

import pytest

pytest.importorskip("numba.cuda")

from ninfer.kernels_numba.templates import unroll  # noqa: E402


def _run(source: str) -> list:
    seen: list = []
    exec(compile(unroll(source), "<unrolled>", "exec"), {"seen": seen})  # noqa: S102  (test source)
    return seen


def test_unrolled_loops_become_straight_code_with_literal_indices():
    source = "for i in unrolled(3):\n    seen.append(i * 10)\nseen.append('after')"
    assert "for" not in unroll(source)
    assert "seen.append(2 * 10)" in unroll(source)
    assert _run(source) == [0, 10, 20, "after"]


def test_nested_counts_may_use_the_enclosing_variable():
    source = ("for r in unrolled(4):\n"
              "    for s in unrolled(r):\n"
              "        seen.append((r, s))\n"
              "    for e in unrolled(2 * (r + 1)):\n"
              "        seen.append(('tag', r, e))\n")
    got = _run(source)
    assert [x for x in got if x[0] != "tag"] == [(r, s) for r in range(4) for s in range(r)]
    assert [x for x in got if x[0] == "tag"] == [("tag", r, e) for r in range(4) for e in range(2 * (r + 1))]


def test_ordinary_loops_and_names_that_contain_the_variable_are_left_alone():
    source = ("for k in unrolled(2):\n"
              "    kk = k + 1\n"
              "    for j in range(kk):\n"
              "        seen.append((k, j))\n")
    text = unroll(source)
    assert "range(kk)" in text and "kk = 1 + 1" in text
    assert _run(source) == [(0, 0), (1, 0), (1, 1)]
