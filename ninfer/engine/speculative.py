"""Speculative decoding (MTP and DFlash): the §4.7 accept rules, and the per-request counters the engine reports.

The accept rules are the reference a runner applies to its verify logits (the CPU runner calls `verify_drafts`
directly; a CUDA kernel is checked against it). Drafts are greedy proposals (MTP head or DFlash drafter), i.e. a
one-hot proposal distribution, so accepting draft i with probability p_i(draft_i) and otherwise sampling p_i without
the draft keeps the target distribution exactly; under greedy sampling the output is token-identical to
non-speculative decoding.
"""

from __future__ import annotations

import attrs
import numpy as np

from ninfer.engine.sampler import Purpose, Sampler, draw, uniform


def verify_drafts(logits: np.ndarray, drafts: np.ndarray, sampler: Sampler, base: int) -> tuple[int, list[int]]:
    """Accept a prefix of `drafts` `[k]` against verify logits `[k+1, vocab_rows]` (column i read the round's input
    token and drafts[:i]); `base` is L, the round's E. Returns (A accepted drafts, the A+1 produced tokens: the
    accepted drafts, then the correction at the first rejection or the bonus token after all k).

    Greedy: draft i is accepted while it equals column i's argmax. Sampled: column i's processed distribution p_i
    (penalty counts include drafts accepted earlier in the round) accepts draft i when U(seed, L+i+1, accept) <
    p_i(draft_i); a rejection draws from p_i without the draft with U(seed, L+i+1, correction); after k acceptances
    the bonus token is drawn from column k with U(seed, L+k+1, bonus).
    """
    if sampler.params.is_greedy:
        for i, draft in enumerate(int(d) for d in drafts):
            best = sampler.argmax(logits[i])
            if best != draft:
                return i, [int(d) for d in drafts[:i]] + [best]
        return len(drafts), [int(d) for d in drafts] + [sampler.argmax(logits[len(drafts)])]
    return _verify_sampled(lambda i: sampler.candidates(logits[i]), drafts, sampler, base)


def verify_candidates(ids: np.ndarray, values: np.ndarray, drafts: np.ndarray, sampler: Sampler,
                      base: int) -> tuple[int, list[int]]:
    """`verify_drafts` for a sampled request from each column's TOP_K_CAP best penalised candidates (ids and
    values `[k+1, 20]`, as `Sampler.sample_top` takes them) computed with the round's earlier drafts counted for the
    penalties (the CUDA runner's device candidates): the same decisions, without the columns' logits."""
    return _verify_sampled(lambda i: sampler.kept(ids[i], values[i]), drafts, sampler, base)


def _verify_sampled(column, drafts: np.ndarray, sampler: Sampler, base: int) -> tuple[int, list[int]]:
    """The sampled accept rules over `column(i)`: column i's kept candidate ids and weights, computed with the
    drafts before i counted (the host sampler counts each accepted draft before asking for the next column)."""
    k = len(drafts)
    produced: list[int] = []
    seed = sampler.params.seed
    for i in range(k):
        draft = int(drafts[i])
        ids, weights = column(i)
        at = np.flatnonzero(ids == draft)
        total = np.cumsum(weights, dtype=np.float32)[-1]
        probability = float(weights[at[0]] / total) if at.size else 0.0
        if uniform(seed, base + i + 1, Purpose.SPECULATIVE_ACCEPT) < probability:
            sampler.count(draft)
            produced.append(draft)
            continue
        others = ids != draft  # never empty here: a lone candidate has probability 1 and is always accepted
        correction = draw(ids[others], weights[others], uniform(seed, base + i + 1, Purpose.CORRECTION))
        sampler.count(correction)
        return i, produced + [correction]
    ids, weights = column(k)
    bonus = draw(ids, weights, uniform(seed, base + k + 1, Purpose.BONUS))
    sampler.count(bonus)
    return k, produced + [bonus]


@attrs.define
class SpeculativeCounters:
    """Per request (§4.7): verify rounds, drafted and accepted tokens, ordinary steps taken while speculative
    decoding was on, and how often each draft position was accepted."""

    draft_window: int
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    fallback_steps: int = 0
    accepted_per_position: list[int] = attrs.Factory(lambda self: [0] * self.draft_window, takes_self=True)

    def record_round(self, accepted: int) -> None:
        self.rounds += 1
        self.drafted_tokens += self.draft_window
        self.accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def record_fallback(self) -> None:
        self.fallback_steps += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        return 1.0 + self.accepted_tokens / self.rounds if self.rounds else 0.0
