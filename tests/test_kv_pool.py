"""KV pool sizing (serving.md's --kv-capacity / --max-context rules) and the page allocator."""

import pytest

from ninfer.engine.kv_pool import AUTO_HEADROOM_BYTES, KVCapacityError, PageOwnershipError, PagePool, plan_kv_pool


def plan(**kwargs):
    args = dict(kv_capacity=None, max_context=8192, lanes=2, bytes_per_token=1000)
    return plan_kv_pool(**{**args, **kwargs})


def test_omitted_capacity_follows_the_context_and_explicit_capacity_rounds_up_to_pages():
    assert (plan().policy, plan().pages) == ("max_context", 128)
    explicit = plan(kv_capacity=10_000)
    assert (explicit.policy, explicit.pages, explicit.capacity_tokens) == ("explicit", 157, 10_048)
    assert plan(max_context=100, kv_capacity=None).pages == 2


def test_auto_fills_the_budget_after_headroom_up_to_what_the_lanes_can_use():
    per_page = 1000 * 64
    budget = AUTO_HEADROOM_BYTES + 5_000_000 + 200 * per_page + 123
    auto = plan(kv_capacity="auto", memory_budget=budget, reserved_bytes=5_000_000)
    assert (auto.policy, auto.pages) == ("auto", 200)
    assert plan(kv_capacity="auto", memory_budget=10 * AUTO_HEADROOM_BYTES).pages == 256  # 2 lanes x 128 pages
    with pytest.raises(KVCapacityError, match="needs a memory budget"):
        plan(kv_capacity="auto")


@pytest.mark.parametrize("kwargs,message", [
    (dict(kv_capacity=4096), "smaller than one sequence"),
    (dict(kv_capacity="auto", memory_budget=AUTO_HEADROOM_BYTES + 1000), "smaller than one sequence"),
    (dict(kv_capacity=128, max_context=64, lanes=4), "cannot give each of the 4 lanes a page"),
    (dict(kv_capacity=3 * 8192), "larger than 2 lanes"),
    (dict(kv_capacity=0), "positive token count"),
    (dict(kv_capacity="lots"), "positive token count"),
])
def test_impossible_pools_are_rejected(kwargs, message):
    with pytest.raises(KVCapacityError, match=message):
        plan(**kwargs)


def test_pages_are_owned_once_and_come_back():
    pool = PagePool(6)
    a = pool.allocate(0, 4)
    b = pool.allocate(1, 2)
    assert sorted(a + b) == list(range(6)) and pool.free == 0
    assert pool.owned_by(1) == sorted(b)
    with pytest.raises(PageOwnershipError, match="asked for 1 pages, 0 are free"):
        pool.allocate(2, 1)
    with pytest.raises(PageOwnershipError, match="owned by 0"):
        pool.release(1, a[:1])
    pool.release(0, a)
    pool.release(1, b)
    assert pool.free == 6 and pool.owned_by(0) == [] and pool.owned_by(1) == []
    with pytest.raises(PageOwnershipError):
        pool.release(0, a[:1])  # a double free
