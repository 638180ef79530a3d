"""What every model offers the layers above it, and where its weights come from.

A model holds no per-request data: `new_state()` makes the carried state of one sequence (KV caches, GDN conv and
recurrent state, position), and `forward(state, ids)` runs those tokens as the continuation of that state: a prefill
of N tokens, then incremental decode, with identical results either way.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import attrs
import numpy as np


class WeightSource(Protocol):
    """Named tensors in ninfer layout: float formats come back as float32 (dequantized), I32 as int32."""

    def get(self, name: str) -> np.ndarray: ...

    def has(self, name: str) -> bool: ...


class DictWeights:
    """A WeightSource over an in-memory mapping (tests, and models built directly from arrays)."""

    def __init__(self, tensors: dict[str, np.ndarray]) -> None:
        self._tensors = tensors

    def get(self, name: str) -> np.ndarray:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"missing weight {name!r}") from None

    def has(self, name: str) -> bool:
        return name in self._tensors


@attrs.frozen
class ForwardResult:
    logits: np.ndarray  # [T, vocab_rows] fp32 (only the last row when logits="last")
    hidden: np.ndarray  # [T, hidden] fp32: the residual stream after the final norm (the MTP head's input)


LogitsWanted = Literal["last", "all"]


class CausalLM(Protocol):
    dims: Any  # QwenDims | LlamaDims

    def new_state(self) -> Any: ...

    def forward(self, state: Any, token_ids: np.ndarray, *, logits: LogitsWanted = "last") -> ForwardResult: ...
