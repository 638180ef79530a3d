"""Placeholder expansion and 3-axis MRoPE positions (facts §3.12, §5.5).

``assign_positions`` equals transformers' ``Qwen3_5Model.get_rope_index`` for one unpadded sequence: runs of equal
token type (0 text, 1 image pad, 2 video pad); a text run gets ``current + i`` on all three axes; a media run (one
image, or one temporal slice of a video) gets T=current, H=current+y, W=current+x over the merged grid, then
``current += max(gh, gw)``.  ``rope_delta = max_position + 1 - T``; decode positions are ``index + rope_delta``.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np

from ninfer.media.image import MERGE_SIZE, MediaError

VISION_START_ID = 248053
VISION_END_ID = 248054
IMAGE_PAD_ID = 248056
VIDEO_PAD_ID = 248057

TEXT, IMAGE, VIDEO = 0, 1, 2


class PositionError(MediaError):
    """Token types and media grids disagree (wrong placeholder count or length)."""


def _merged_tokens(grid: Sequence[int], merge_size: int) -> int:
    t, h, w = (int(v) for v in grid)
    if t <= 0 or h <= 0 or w <= 0 or h % merge_size or w % merge_size:
        raise PositionError(f"invalid grid {tuple(grid)} for merge size {merge_size}")
    return t * (h // merge_size) * (w // merge_size)


def image_placeholder_ids(grid: Sequence[int], merge_size: int = MERGE_SIZE) -> list[int]:
    """``<|vision_start|>`` + ``<|image_pad|>`` x (t*h*w/merge^2) + ``<|vision_end|>``."""
    return [VISION_START_ID] + [IMAGE_PAD_ID] * _merged_tokens(grid, merge_size) + [VISION_END_ID]


def expand_image_placeholders(
    token_ids: Iterable[int], grids: Sequence[Sequence[int]], merge_size: int = MERGE_SIZE
) -> list[int]:
    """Replace the i-th single ``<|image_pad|>`` (as rendered by the template, inside
    ``<|vision_start|>``...``<|vision_end|>``) with ``<|image_pad|>`` x tokens of ``grids[i]``."""
    ids = list(token_ids)
    out: list[int] = []
    n = 0
    for i, tok in enumerate(ids):
        if tok != IMAGE_PAD_ID:
            out.append(tok)
            continue
        if n >= len(grids):
            raise PositionError(f"more <|image_pad|> placeholders than images ({len(grids)})")
        if i == 0 or ids[i - 1] != VISION_START_ID or i + 1 >= len(ids) or ids[i + 1] != VISION_END_ID:
            raise PositionError("<|image_pad|> placeholder must sit between <|vision_start|> and <|vision_end|>")
        out.extend([IMAGE_PAD_ID] * _merged_tokens(grids[n], merge_size))
        n += 1
    if n != len(grids):
        raise PositionError(f"{len(grids)} images but {n} <|image_pad|> placeholders")
    return out


def token_types(token_ids: Iterable[int]) -> np.ndarray:
    """0 text, 1 ``<|image_pad|>``, 2 ``<|video_pad|>`` (HF ``mm_token_type_ids``)."""
    ids = np.asarray(list(token_ids), dtype=np.int64)
    types = np.zeros(ids.shape, dtype=np.int8)
    types[ids == IMAGE_PAD_ID] = IMAGE
    types[ids == VIDEO_PAD_ID] = VIDEO
    return types


def assign_positions(
    types: Sequence[int] | np.ndarray,
    grids: Sequence[Sequence[int]],
    merge_size: int = MERGE_SIZE,
) -> tuple[np.ndarray, int]:
    """``types`` per token, ``grids`` (t, h, w) in patch units per media item in order of appearance
    (a video with t>1 covers t consecutive media runs, one per temporal slice).
    Returns (positions int64 ``[3, T]``, rope_delta)."""
    tt = np.asarray(types, dtype=np.int64).reshape(-1)
    n = int(tt.shape[0])
    positions = np.empty((3, n), dtype=np.int64)
    if n == 0:
        return positions, 0
    bounds = np.flatnonzero(np.diff(tt)) + 1
    starts = np.concatenate(([0], bounds))
    ends = np.concatenate((bounds, [n]))
    grid_iter = iter(grids)
    pending: list[tuple[int, int]] = []  # remaining (h, w) slices of the current video
    current = 0
    for s, e in zip(starts.tolist(), ends.tolist()):
        kind = int(tt[s])
        length = e - s
        if kind == TEXT:
            positions[:, s:e] = np.arange(current, current + length, dtype=np.int64)
            current += length
            continue
        if kind not in (IMAGE, VIDEO):
            raise PositionError(f"unknown token type {kind}")
        if pending and kind == VIDEO:
            h, w = pending.pop(0)
        else:
            if pending:
                raise PositionError("video slices missing before the next image")
            try:
                t, h, w = (int(v) for v in next(grid_iter))
            except StopIteration:
                raise PositionError("more media runs than grids") from None
            _merged_tokens((t, h, w), merge_size)
            if t != 1:
                if kind != VIDEO:
                    raise PositionError(f"image grid must have t=1, got {t}")
                pending = [(h, w)] * (t - 1)
        gh, gw = h // merge_size, w // merge_size
        if length != gh * gw:
            raise PositionError(f"media run of {length} tokens, grid expects {gh * gw}")
        ys, xs = np.divmod(np.arange(length, dtype=np.int64), gw)
        positions[0, s:e] = current
        positions[1, s:e] = current + ys
        positions[2, s:e] = current + xs
        current += max(gh, gw)
    if pending or next(grid_iter, None) is not None:
        raise PositionError("fewer media runs than grids")
    rope_delta = int(positions.max()) + 1 - n
    return positions, rope_delta


def video_placeholder_ids(
    grid: Sequence[int],
    timestamps: Sequence[float],
    encode_text: Callable[[str], list[int]],
    merge_size: int = MERGE_SIZE,
) -> list[int]:
    """What replaces a video's single ``<|video_pad|>``: per temporal pair, the tokens of ``<{ts:.1f} seconds>``
    (``encode_text``: the text tokenizer, no special tokens added), ``<|vision_start|>``, ``<|video_pad|>`` x
    (h*w/merge^2), ``<|vision_end|>`` (facts §5.5; the template's outer start/end tokens stay around it)."""
    t = int(grid[0])
    per_frame = _merged_tokens((1, grid[1], grid[2]), merge_size)
    if t <= 0 or len(timestamps) != t:
        raise PositionError(f"video grid {tuple(grid)} needs {t} timestamps, got {len(timestamps)}")
    out: list[int] = []
    for ts in timestamps:
        out.extend(int(x) for x in encode_text(f"<{ts:.1f} seconds>"))
        out.append(VISION_START_ID)
        out.extend([VIDEO_PAD_ID] * per_frame)
        out.append(VISION_END_ID)
    return out


def expand_video_placeholders(
    token_ids: Iterable[int],
    videos: Sequence[tuple[Sequence[int], Sequence[float]]],
    encode_text: Callable[[str], list[int]],
    merge_size: int = MERGE_SIZE,
) -> list[int]:
    """Replace the i-th single ``<|video_pad|>`` (inside ``<|vision_start|>``...``<|vision_end|>``) with
    ``video_placeholder_ids(*videos[i])``; ``videos`` holds (grid, per-pair timestamps) in prompt order."""
    ids = list(token_ids)
    out: list[int] = []
    n = 0
    for i, tok in enumerate(ids):
        if tok != VIDEO_PAD_ID:
            out.append(tok)
            continue
        if n >= len(videos):
            raise PositionError(f"more <|video_pad|> placeholders than videos ({len(videos)})")
        if i == 0 or ids[i - 1] != VISION_START_ID or i + 1 >= len(ids) or ids[i + 1] != VISION_END_ID:
            raise PositionError("<|video_pad|> placeholder must sit between <|vision_start|> and <|vision_end|>")
        grid, timestamps = videos[n]
        out.extend(video_placeholder_ids(grid, timestamps, encode_text, merge_size))
        n += 1
    if n != len(videos):
        raise PositionError(f"{len(videos)} videos but {n} <|video_pad|> placeholders")
    return out
