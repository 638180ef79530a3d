"""The DFlash drafter's context caches on the CPU runner (ninfer-facts §3.10, §4.1, §4.4, §4.6).

Per lane, every drafter layer keeps the K/V of the committed target positions, stored BF16 whatever --kv-dtype says:
a sliding layer in a cyclic cache of `sliding_window` slots (position p at slot p % window: a block query at L+i sees
context positions after L+i-window, all of which are still there), a full layer in the shared page pool under the
lane's page table, like the target's attention KV.

The context grows by committed positions only. Prefill chunks are committed as they run. A decode round leaves the
context features of the columns it committed pending, and they are projected into the caches at the lane's next
call (its next round, prefill or checkpoint): a stop that keeps fewer tokens of the round just keeps fewer pending
rows (`keep_pending`), so nothing has to be undone in the cyclic caches. A checkpoint copies the cyclic caches; the
full layers' prefix stays in the pages the engine keeps.
"""

from __future__ import annotations

import attrs
import numpy as np

from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits
from ninfer.backends.cpu.paged_kv import PagedLayerKV, kv_bytes_per_token
from ninfer.models.dflash import ContextKV, DFlashDrafter
from ninfer.targets.dims import DFlashDims

DFLASH_KV_DTYPE = "bf16"  # DFlash caches are BF16 whatever the target's KV dtype


class DFlashContextError(RuntimeError):
    """A call would leave the drafter's context out of step with the target (an engine bug, never a user error)."""


@attrs.define(eq=False)
class DFlashLaneState:
    """One lane's drafter context: the cyclic caches, how many positions the caches hold, and the committed
    positions still to project."""

    rings: dict[int, np.ndarray]  # sliding layer -> bf16 bits [2 (K, V), window, kv_heads, head_dim]
    pending: np.ndarray  # [n, feature_width] context features of positions length..length+n-1
    length: int = 0  # positions 0..length-1 are in the caches

    @property
    def frontier(self) -> int:
        """The committed positions the context covers, pending ones included (the target's E)."""
        return self.length + len(self.pending)

    def copy(self) -> DFlashLaneState:
        return DFlashLaneState(rings={layer: ring.copy() for layer, ring in self.rings.items()},
                               pending=self.pending.copy(), length=self.length)

    def keep_pending(self, kept: int) -> None:
        """Commit only the first `kept` columns of the last round (a stop cut it short)."""
        if not 0 < kept <= len(self.pending):
            raise DFlashContextError(f"the last round left {len(self.pending)} pending columns, cannot keep {kept}")
        self.pending = self.pending[:kept]

    def arrays(self, prefix: str) -> dict[str, np.ndarray]:
        """Named copies for a lane image (`from_arrays` is the inverse)."""
        out = {f"{prefix}/ring/{layer}": ring.copy() for layer, ring in self.rings.items()}
        out[f"{prefix}/pending"] = self.pending.copy()
        out[f"{prefix}/length"] = np.array(self.length, np.int64)
        return out

    @classmethod
    def from_arrays(cls, prefix: str, arrays: dict[str, np.ndarray], like: DFlashLaneState) -> DFlashLaneState:
        return cls(rings={layer: arrays[f"{prefix}/ring/{layer}"].copy() for layer in like.rings},
                   pending=arrays[f"{prefix}/pending"].copy(), length=int(arrays[f"{prefix}/length"]))


class DFlashCaches:
    """The runner's side of DFlash: the full layers' page pools and the operations on a lane's context."""

    def __init__(self, drafter: DFlashDrafter, pages: int, page_tokens: int) -> None:
        dims = drafter.dims
        self.drafter, self.dims = drafter, dims
        self.pools = {layer: PagedLayerKV(pages, page_tokens, dims.kv_heads, dims.head_dim, DFLASH_KV_DTYPE)
                      for layer in dims.full_layers()}

    def new_lane(self) -> DFlashLaneState:
        d = self.dims
        shape = (2, d.sliding_window, d.kv_heads, d.head_dim)
        return DFlashLaneState(rings={layer: np.zeros(shape, np.uint16) for layer in d.sliding_layers()},
                               pending=np.zeros((0, d.feature_width), np.float32))

    def commit_pending(self, state: DFlashLaneState, page_table: np.ndarray) -> None:
        """Project the pending positions into the caches."""
        if len(state.pending):
            features, state.pending = state.pending, state.pending[:0]
            self.extend(state, page_table, features)

    def extend(self, state: DFlashLaneState, page_table: np.ndarray, features: np.ndarray) -> None:
        """Project committed positions length..length+n-1 (their context features `[n, feature_width]`) into the
        caches."""
        if len(state.pending):
            raise DFlashContextError("pending positions must be committed before later ones")
        start, count = state.length, len(features)
        window = self.dims.sliding_window
        per_layer = self.drafter.context_keys_values(features, np.arange(start, start + count))
        for layer, (k, v) in enumerate(per_layer):
            if layer in self.pools:
                self.pools[layer].write(page_table, start, k, v)
                continue
            # Only the last `window` positions of a long chunk survive in the cyclic cache.
            keep = slice(max(0, count - window), count)
            slots = np.arange(start, start + count)[keep] % window
            state.rings[layer][0, slots] = f32_to_bf16_bits(k[keep])
            state.rings[layer][1, slots] = f32_to_bf16_bits(v[keep])
        state.length += count

    def context(self, state: DFlashLaneState, page_table: np.ndarray) -> list[ContextKV]:
        """Every drafter layer's context of the lane, as a block of it sees it: a sliding layer's last `window`
        positions (the only ones its block queries can reach), a full layer's every position."""
        if len(state.pending):
            raise DFlashContextError("a block needs the pending positions committed first")
        length, window = state.length, self.dims.sliding_window
        recent = np.arange(max(0, length - window), length)
        out = []
        for layer in range(self.dims.layers):
            if layer in self.pools:
                keys, values = self.pools[layer].read(page_table, length)
                out.append(ContextKV(keys, values, np.arange(length)))
            else:
                ring = state.rings[layer][:, recent % window]
                out.append(ContextKV(bf16_bits_to_f32(ring[0]), bf16_bits_to_f32(ring[1]), recent))
        return out


def dflash_kv_bytes_per_token(dims: DFlashDims) -> int:
    """Shared-pool bytes one token takes in the drafter's full layers."""
    return kv_bytes_per_token(len(dims.full_layers()), dims.kv_heads, dims.head_dim, DFLASH_KV_DTYPE)


def dflash_lane_bytes(dims: DFlashDims) -> int:
    """One lane's cyclic caches (K and V of every sliding layer)."""
    return len(dims.sliding_layers()) * 2 * dims.sliding_window * dims.kv_heads * dims.head_dim * 2
