"""A rendered prompt's media placeholders expanded with the prepared items (ninfer-facts §3.12, §5.5).

The chat template renders each image as `<|vision_start|><|image_pad|><|vision_end|>` and each video as
`<|vision_start|><|video_pad|><|vision_end|>`. Once the items are prepared, an image's single pad becomes
`<|image_pad|>` x its merged tokens, and a video's becomes, per temporal pair, the tokens of `<{ts:.1f} seconds>`,
`<|vision_start|>`, `<|video_pad|>` x tokens per frame, `<|vision_end|>` (the template's outer start/end stay
around it): the ids transformers' Qwen3.5/3.6 processor tokenizes from its expanded text. Positions are the
three-axis MRoPE positions of `assign_positions` (transformers' `get_rope_index`), and each item's columns are the
prompt indices of its pad tokens, in order.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import attrs
import numpy as np

from ninfer.media.positions import (IMAGE, IMAGE_PAD_ID, TEXT, VIDEO, VIDEO_PAD_ID, PositionError,
                                    assign_positions, expand_image_placeholders, expand_video_placeholders,
                                    token_types)


class PreparedItem(Protocol):
    """What expansion reads of a prepared item (ninfer.media.prepare.PreparedPayload has these)."""

    grid: tuple[int, int, int]
    num_tokens: int
    timestamps: tuple[float, ...]


@attrs.frozen(eq=False)
class ExpandedMedia:
    ids: tuple[int, ...]  # the complete prompt, placeholders expanded
    positions: np.ndarray  # int64 [3, T] MRoPE (T, H, W) positions
    rope_delta: int
    columns: tuple[np.ndarray, ...]  # per item, in prompt order: the int32 indices of its pad tokens


def placeholder_modalities(ids: Sequence[int]) -> list[str]:
    """The modality of each (unexpanded) placeholder in `ids`, in order."""
    return ["image" if t == IMAGE_PAD_ID else "video" for t in ids if t in (IMAGE_PAD_ID, VIDEO_PAD_ID)]


def expand_media(ids: Sequence[int], modalities: Sequence[str], items: Sequence[PreparedItem],
                 encode_text: Callable[[str], list[int]]) -> ExpandedMedia:
    """Expand the one-pad placeholders of `ids` (as the template rendered them) with `items`, the prepared media
    in prompt order (`modalities[i]` is item i's). `encode_text` tokenizes plain text without special tokens.
    Raises PositionError when the placeholders and the items disagree."""
    if len(modalities) != len(items):
        raise PositionError(f"{len(modalities)} media parts but {len(items)} prepared items")
    found = placeholder_modalities(ids)
    if found != list(modalities):
        raise PositionError(f"the prompt has {len(found)} media placeholders ({', '.join(found) or 'none'}) for "
                            f"{len(modalities)} media parts ({', '.join(modalities) or 'none'}); media placeholder "
                            f"tokens cannot be written as text")
    images = [item.grid for item, kind in zip(items, modalities) if kind == "image"]
    videos = [(item.grid, item.timestamps) for item, kind in zip(items, modalities) if kind == "video"]
    expanded = expand_image_placeholders(ids, images) if images else list(ids)
    if videos:
        expanded = expand_video_placeholders(expanded, videos, encode_text)
    types = token_types(expanded)
    positions, rope_delta = assign_positions(types, [item.grid for item in items])
    pads = np.flatnonzero(types != TEXT).astype(np.int32)
    columns: list[np.ndarray] = []
    start = 0
    for item, kind in zip(items, modalities):
        cols = pads[start:start + int(item.num_tokens)]
        want = IMAGE if kind == "image" else VIDEO
        if cols.size != item.num_tokens or np.any(types[cols] != want):
            raise PositionError(f"a {kind} of {item.num_tokens} tokens does not match its expanded placeholder")
        columns.append(cols)
        start += int(item.num_tokens)
    if start != pads.size:
        raise PositionError(f"{pads.size} media tokens in the expanded prompt, {start} from the items")
    return ExpandedMedia(tuple(int(t) for t in expanded), positions, rope_delta, tuple(columns))
