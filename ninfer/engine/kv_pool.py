"""The shared KV page pool: sizing at startup (serving.md's --kv-capacity / --max-context rules) and the page
allocator with ownership, so a page is never in two sequences and every page comes back."""

from __future__ import annotations

from typing import Literal

import attrs

PAGE_TOKENS = 64
AUTO_HEADROOM_BYTES = 1 << 30  # --kv-capacity auto keeps 1 GiB of sizing headroom


class KVCapacityError(ValueError):
    """The configured KV pool cannot work (startup rejection)."""


def pages_for(tokens: int, page_tokens: int = PAGE_TOKENS) -> int:
    return -(-tokens // page_tokens)


@attrs.frozen(kw_only=True)
class KVPoolPlan:
    policy: str  # "explicit" | "max_context" | "auto"
    pages: int
    page_tokens: int = PAGE_TOKENS

    @property
    def capacity_tokens(self) -> int:
        return self.pages * self.page_tokens


def plan_kv_pool(*, kv_capacity: int | Literal["auto"] | None, max_context: int, lanes: int, bytes_per_token: int,
                 memory_budget: int | None = None, reserved_bytes: int = 0,
                 page_tokens: int = PAGE_TOKENS) -> KVPoolPlan:
    """Pages of the shared pool. Omitted: one full-length sequence (--max-context). N: exactly that many tokens,
    rounded up to whole pages, never silently reduced. auto: the most pages `memory_budget` (bytes left after the
    weights) holds after `reserved_bytes` of fixed runtime state and 1 GiB headroom, at most what all lanes can use.

    Rejected: a pool smaller than one sequence, with fewer pages than lanes, or larger than all lanes could use.
    """
    sequence_pages = pages_for(max_context, page_tokens)
    usable = lanes * sequence_pages
    if kv_capacity is None:
        policy, pages = "max_context", sequence_pages
    elif kv_capacity == "auto":
        if memory_budget is None:
            raise KVCapacityError("--kv-capacity auto needs a memory budget to size from")
        free = memory_budget - reserved_bytes - AUTO_HEADROOM_BYTES
        policy, pages = "auto", min(usable, max(0, free // (bytes_per_token * page_tokens)))
    elif isinstance(kv_capacity, int) and kv_capacity > 0:
        policy, pages = "explicit", pages_for(kv_capacity, page_tokens)
    else:
        raise KVCapacityError(f"--kv-capacity must be a positive token count or 'auto', got {kv_capacity!r}")
    if pages < sequence_pages:
        raise KVCapacityError(f"a KV pool of {pages * page_tokens} tokens is smaller than one sequence of "
                              f"--max-context {max_context} ({sequence_pages} pages of {page_tokens})")
    if pages < lanes:
        raise KVCapacityError(f"a KV pool of {pages} pages cannot give each of the {lanes} lanes a page")
    if pages > usable:
        raise KVCapacityError(f"a KV pool of {pages} pages is larger than {lanes} lanes of --max-context "
                              f"{max_context} could use ({usable} pages)")
    return KVPoolPlan(policy=policy, pages=pages, page_tokens=page_tokens)


class PageOwnershipError(RuntimeError):
    """A page was freed by a lane that does not own it, or more pages were asked for than are free (engine bug)."""


class PagePool:
    """Allocator of page ids 0..pages-1; each allocated page records its owning lane."""

    FREE = -1

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self._owner = [self.FREE] * pages
        self._free = list(range(pages - 1, -1, -1))  # a stack: low ids are handed out first

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, owner: int, count: int) -> list[int]:
        if count > len(self._free):
            raise PageOwnershipError(f"lane {owner} asked for {count} pages, {len(self._free)} are free")
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._owner[page] = owner
        return pages

    def release(self, owner: int, pages: list[int]) -> None:
        for page in pages:
            if self._owner[page] != owner:
                raise PageOwnershipError(f"lane {owner} freed page {page}, owned by {self._owner[page]}")
            self._owner[page] = self.FREE
            self._free.append(page)

    def owned_by(self, owner: int) -> list[int]:
        return [page for page, who in enumerate(self._owner) if who == owner]
