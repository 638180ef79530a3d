"""Paged attention KV on the CPU: one shared pool of fixed-size token pages per attention layer.

A sequence owns an ordered page table of int32 page ids; its token i lives in page `table[i // page_tokens]` at
offset `i % page_tokens`. Storage is bf16 (round to nearest even) or the INT8-G64 codec of ninfer-facts §4.1, so the
values attention reads back are exactly what the CUDA cache would hold.
"""

from __future__ import annotations

import numpy as np

from ninfer.artifact.codec import bf16_bits_to_f32, f32_to_bf16_bits

F32 = np.float32
KV_DTYPES = ("bf16", "int8")
INT8_GROUP = 64  # head dims per INT8 scale


class KVPageError(RuntimeError):
    """A write or read beyond the pages a sequence owns (an engine accounting bug, never a user error)."""


def int8_group(head_dim: int) -> int:
    """Head dims per INT8 scale: 64, or the whole head when it is narrower (tiny test models)."""
    group = min(INT8_GROUP, head_dim)
    if head_dim % group:
        raise ValueError(f"INT8 KV needs head_dim to be a multiple of {INT8_GROUP}, got {head_dim}")
    return group


def quantize_int8(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """§4.1 per group of `group` values along the last axis: `s = fp16(amax / 127)`, `inv = 1/s` (0 when s is 0),
    `code = clamp(rne(x * inv), -127, 127)`. Returns (int8 codes, float16 scales `[..., D / group]`)."""
    grouped = x.astype(F32, copy=False).reshape(x.shape[:-1] + (x.shape[-1] // group, group))
    scales = (np.max(np.abs(grouped), axis=-1) / F32(127.0)).astype(np.float16)
    wide = scales.astype(F32)
    with np.errstate(divide="ignore"):
        inverse = np.where(wide == 0, F32(0.0), F32(1.0) / wide).astype(F32)
    codes = np.clip(np.rint(grouped * inverse[..., None]), -127, 127).astype(np.int8)
    return codes.reshape(x.shape), scales


def dequantize_int8(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    group = codes.shape[-1] // scales.shape[-1]
    grouped = codes.astype(F32).reshape(codes.shape[:-1] + (scales.shape[-1], group))
    return (grouped * scales.astype(F32)[..., None]).reshape(codes.shape)


def kv_bytes_per_token(attention_layers: int, kv_heads: int, head_dim: int, dtype: str) -> int:
    """Bytes one token's K and V take over `attention_layers` layers (INT8 includes its fp16 scales)."""
    if dtype == "bf16":
        per_row = 2 * head_dim
    elif dtype == "int8":
        per_row = head_dim + 2 * (head_dim // int8_group(head_dim))
    else:
        raise ValueError(f"KV dtype must be one of {KV_DTYPES}, got {dtype!r}")
    return attention_layers * 2 * kv_heads * per_row


class PagedLayerKV:
    """K and V of one attention layer for every page of the shared pool."""

    def __init__(self, pages: int, page_tokens: int, kv_heads: int, head_dim: int, dtype: str) -> None:
        if dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype must be one of {KV_DTYPES}, got {dtype!r}")
        self.page_tokens, self.dtype = page_tokens, dtype
        shape = (pages, page_tokens, kv_heads, head_dim)
        if dtype == "bf16":
            self._k, self._v = np.zeros(shape, np.uint16), np.zeros(shape, np.uint16)
        else:
            self._group = int8_group(head_dim)
            scale_shape = shape[:-1] + (head_dim // self._group,)
            self._k, self._v = np.zeros(shape, np.int8), np.zeros(shape, np.int8)
            self._k_scale, self._v_scale = np.zeros(scale_shape, np.float16), np.zeros(scale_shape, np.float16)

    def write(self, page_table: np.ndarray, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store `[T, kv_heads, head_dim]` rows for tokens start..start+T-1 of the sequence owning `page_table`."""
        tokens = np.arange(start, start + k.shape[0])
        if tokens.size and tokens[-1] >= len(page_table) * self.page_tokens:
            raise KVPageError(f"token {tokens[-1]} is beyond the {len(page_table)} pages this sequence owns")
        pages, offsets = page_table[tokens // self.page_tokens], tokens % self.page_tokens
        if self.dtype == "bf16":
            self._k[pages, offsets] = f32_to_bf16_bits(k)
            self._v[pages, offsets] = f32_to_bf16_bits(v)
        else:
            self._k[pages, offsets], self._k_scale[pages, offsets] = quantize_int8(k, self._group)
            self._v[pages, offsets], self._v_scale[pages, offsets] = quantize_int8(v, self._group)

    def read(self, page_table: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens 0..length-1 as fp32 `[length, kv_heads, head_dim]` K and V."""
        used = -(-length // self.page_tokens)
        if used > len(page_table):
            raise KVPageError(f"{length} tokens need {used} pages, the sequence owns {len(page_table)}")
        pages = page_table[:used]

        def gather(store: np.ndarray) -> np.ndarray:
            return store[pages].reshape((used * self.page_tokens,) + store.shape[2:])[:length]

        if self.dtype == "bf16":
            return bf16_bits_to_f32(gather(self._k)), bf16_bits_to_f32(gather(self._v))
        return (dequantize_int8(gather(self._k), gather(self._k_scale)),
                dequantize_int8(gather(self._v), gather(self._v_scale)))

    def _stores(self) -> dict[str, np.ndarray]:
        stores = {"k": self._k, "v": self._v}
        if self.dtype == "int8":
            stores.update(k_scale=self._k_scale, v_scale=self._v_scale)
        return stores

    def export_pages(self, pages: np.ndarray) -> dict[str, np.ndarray]:
        """Copies of these pages' stored bytes (K, V and the INT8 scales), named for `import_pages`."""
        return {name: store[pages].copy() for name, store in self._stores().items()}

    def import_pages(self, pages: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        """Write exported page contents into these pages (the same count, in order)."""
        for name, store in self._stores().items():
            store[pages] = arrays[name]


class PagedKVView:
    """One sequence's view of one layer's pages: the KV store protocol the model's attention layers write through."""

    def __init__(self, layer: PagedLayerKV, page_table: np.ndarray, length: int) -> None:
        self._layer, self._table, self.length = layer, page_table, length

    def append(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self._layer.write(self._table, self.length, k, v)
        self.length += k.shape[0]
        return self._layer.read(self._table, self.length)
