"""The sampling pipeline and its counter-based RNG (ninfer-facts §4.8).

Every draw is a pure function of (seed, position, purpose), so a request replays identically wherever it runs, and the
CUDA sampler can be checked against this one draw for draw. The math is fp32 with sequential sums, as on the device.
"""

from __future__ import annotations

import enum
import math
import secrets

import attrs
import numpy as np

from ninfer.targets.registry import SamplingDefaults

_MASK64 = (1 << 64) - 1
TOP_K_CAP = 20  # NInfer never samples outside the 20 best candidates


class Purpose(enum.IntEnum):
    PREFILL = 0  # position = prompt length
    DECODE = 1  # position = index of the input token
    SPECULATIVE_ACCEPT = 2
    CORRECTION = 3
    BONUS = 4


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int, purpose: Purpose, sub: int = 0) -> float:
    """u in [0, 1) with 24 bits: `U(seed, position, purpose)`."""
    key = splitmix64((seed ^ ((position & 0xFFFFFFFF) * 0xD1B54A32D192ED03)) & _MASK64)
    key = splitmix64((key ^ (int(purpose) << 21) ^ (sub * 0x2545F4914F6CDD1D)) & _MASK64)
    return (key >> 40) / float(1 << 24)


class SamplingParamsError(ValueError):
    """A sampling parameter is out of its range (the message names it)."""


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not math.isfinite(value) or not low <= value <= high:
        raise SamplingParamsError(f"{name} must be a finite number in [{low}, {high}], got {value!r}")


@attrs.frozen(kw_only=True)
class SamplingParams:
    temperature: float = 0.6
    top_k: int = 20
    top_p: float = 0.95
    min_p: float = 0.0
    presence_penalty: float = 1.0
    frequency_penalty: float = 0.0
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        _check_range("temperature", self.temperature, 0.0, 2.0)
        _check_range("top_p", self.top_p, 0.0, 1.0)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.top_k < 0:
            raise SamplingParamsError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.seed <= _MASK64:
            raise SamplingParamsError(f"seed must be an unsigned 64-bit integer, got {self.seed}")

    @classmethod
    def greedy(cls) -> "SamplingParams":
        return cls(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalties_active(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@attrs.frozen(kw_only=True)
class SamplingOverrides:
    """Sampling fields one layer of configuration sets (a request, or the process flags); None leaves it open."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None


def resolve_sampling(preset: SamplingDefaults, process: SamplingOverrides, request: SamplingOverrides, *,
                     greedy: bool) -> SamplingParams:
    """serving.md's precedence: request fields over process flags over the target's preset for the request's
    thinking mode; `--greedy` finally forces temperature 0. The seed is the request's, else `--seed`, else fresh."""
    values = attrs.asdict(preset)
    for layer in (process, request):
        values.update({name: value for name, value in attrs.asdict(layer).items()
                       if value is not None and name != "seed"})
    if greedy:
        values["temperature"] = 0.0
    seed = next((s for s in (request.seed, process.seed) if s is not None), None)
    return SamplingParams(**values, seed=secrets.randbits(64) if seed is None else seed)


def top_candidates(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest logits, by logit descending and id ascending on ties."""
    k = min(k, logits.shape[0])
    part = np.argpartition(-logits, k - 1)[:k] if k < logits.shape[0] else np.arange(logits.shape[0])
    # The partition may cut through a run of ties: widen to every id tied with the k-th value, then order exactly.
    kth = logits[part].min()
    pool = np.flatnonzero(logits >= kth)
    order = np.lexsort((pool, -logits[pool]))
    return pool[order][:k]


class Sampler:
    """Per-request sampler: owns the generated-token counts that the penalties read."""

    def __init__(self, params: SamplingParams, vocab_ids: int) -> None:
        self.params = params
        self.vocab_ids = vocab_ids
        self._counts = np.zeros(vocab_ids, dtype=np.int32)

    def sample(self, logits: np.ndarray, position: int, purpose: Purpose) -> int:
        """Choose the next token from one row of logits (only rows [0, vocab_ids) are eligible)."""
        if self.params.is_greedy:
            return self.argmax(logits)
        ids, weights = self.candidates(logits)
        chosen = draw(ids, weights, uniform(self.params.seed, position, purpose))
        self.count(chosen)
        return chosen

    def argmax(self, logits: np.ndarray) -> int:
        return int(np.argmax(np.asarray(logits[: self.vocab_ids], dtype=np.float32)))  # the lowest id wins ties

    def candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Steps 2-6 of the pipeline: the kept candidate ids, best first, and their unnormalised fp32 weights."""
        x = np.asarray(logits[: self.vocab_ids], dtype=np.float32)
        p = self.params
        if p.penalties_active:
            x = x - np.float32(p.presence_penalty) * (self._counts > 0) - np.float32(p.frequency_penalty) * self._counts
            x = x.astype(np.float32)
        ids = top_candidates(x, self._top_k())
        return self._kept(ids, x[ids])

    def sample_top(self, ids: np.ndarray, values: np.ndarray, position: int, purpose: Purpose) -> int:
        """`sample` from the TOP_K_CAP best penalised candidates computed elsewhere (the CUDA runner's device kernel:
        ids by value descending and id ascending, their penalised values; ids < 0 pad a vocabulary under 20)."""
        if self.params.is_greedy:
            raise ValueError("a greedy request takes the argmax, not candidates")
        ids, weights = self.kept(ids, values)
        chosen = draw(ids, weights, uniform(self.params.seed, position, purpose))
        self.count(chosen)
        return chosen

    def kept(self, ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Steps 3-6 over the TOP_K_CAP best penalised candidates computed elsewhere (ids < 0 pad a vocabulary under
        20): the kept ids, best first, and their unnormalised fp32 weights."""
        ids, values = np.asarray(ids), np.asarray(values, dtype=np.float32)
        real = ids >= 0
        k = self._top_k()
        return self._kept(ids[real][:k], values[real][:k])

    def _top_k(self) -> int:
        return effective_top_k(self.params.top_k)

    def _kept(self, ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = self.params
        weights = kept_weights(values, p.temperature, p.min_p, p.top_p)
        return ids[: len(weights)], weights

    def count(self, token: int) -> None:
        """Step 8: a token was generated (the penalties of later draws see it)."""
        if self.params.penalties_active:
            self._counts[token] += 1


def effective_top_k(top_k: int) -> int:
    """Step 3's candidate count: top_k, with 0 (off) and anything past TOP_K_CAP meaning TOP_K_CAP."""
    return TOP_K_CAP if top_k <= 0 or top_k >= TOP_K_CAP else top_k


def kept_weights(values: np.ndarray, temperature: float, min_p: float, top_p: float) -> np.ndarray:
    """Steps 4-6 over the top-k candidates' penalised logits (best first): the temperature weights relative to the
    best, cut by min_p, then by top_p (at least one candidate stays); returns the kept prefix's weights. Each
    weight's exp is taken in float64 and rounded once to fp32, and the sums run in order in fp32: the device's
    sampler (`kernels_numba.sampling.sample_candidates`) computes the same bits."""
    tempered = ((values - values[0]) / np.float32(temperature)).astype(np.float32)
    weights = np.exp(tempered.astype(np.float64)).astype(np.float32)
    keep = len(weights)
    if min_p > 0.0:
        below = np.flatnonzero(weights < np.float32(min_p))  # w_0 == 1, so the threshold is min_p itself
        if below.size:
            keep = int(below[0])
    if top_p < 1.0:
        cumulative = np.cumsum(weights, dtype=np.float32)
        reached = np.flatnonzero(cumulative >= np.float32(top_p) * cumulative[-1])
        if reached.size:
            keep = min(keep, int(reached[0]) + 1)
    return weights[: max(keep, 1)]


def draw(ids: np.ndarray, weights: np.ndarray, u: float) -> int:
    """Step 7: inverse-CDF draw over the candidates with `u` in [0, 1) (weights need not be normalised)."""
    cumulative = np.cumsum(weights, dtype=np.float32)
    threshold = np.float32(u) * cumulative[-1]
    return int(ids[min(int(np.searchsorted(cumulative, threshold, side="right")), len(ids) - 1)])
