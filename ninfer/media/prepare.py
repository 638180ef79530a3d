"""A request's media, prepared: acquire -> (cache hit | decode -> resize -> BF16 pack) on a bounded worker pool, under
the request's budgets (serving.md's media cache paragraph; ninfer-facts §4.2, §5.5).

Each item is acquired (data: or HTTP(S) URL), keyed by the SHA-256 of its bytes plus its modality, and looked up in
the shared `PreparedMediaCache`; a miss builds the payload (float32 patch rows from the image or video processor,
stored as bf16 bits: half the bytes, and what the vision tower reads) on the pool. A request first reserves the
bytes its misses may need through the cache's preparation gate, so concurrent requests cannot deadlock the live
account. The result holds one cache reference per item until the request releases it.
"""

from __future__ import annotations

import io
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import attrs
import numpy as np
from PIL import Image

from ninfer.artifact.codec import f32_to_bf16_bits
from ninfer.media.acquire import AcquiredMedia, AcquireLimits, acquire
from ninfer.media.cache import MODALITIES, MediaHandle, MediaKey, PreparedMediaCache
from ninfer.media.errors import MediaBudgetExceeded
from ninfer.media.image import ImageDecodeError, ImagePreprocessConfig, preprocess_image, smart_resize
from ninfer.media.video import (VideoBudget, VideoPreprocessConfig, preprocess_video, read_header,
                                sample_frame_indices, video_grid)

MAX_SOURCE_BYTES = 256 << 20  # all media bytes of one request (facts §4.2)
MAX_RAW_PATCHES = 131_072  # the Vision runtime's envelope (serving.md)
MAX_VISION_TOKENS = 32_768
MAX_POOL_THREADS = 16


@attrs.frozen
class MediaItem:
    modality: str  # "image" | "video"
    url: str

    def __attrs_post_init__(self) -> None:
        if self.modality not in MODALITIES:
            raise ValueError(f"media modality must be one of {MODALITIES}, got {self.modality!r}")


@attrs.frozen(eq=False)
class PreparedPayload:
    """What the cache keeps for one media item: bf16 patch rows and where they go in the prompt."""

    patches: np.ndarray  # uint16 bf16 bits [rows, 3 * temporal * patch * patch]
    grid: tuple[int, int, int]  # (t, h, w) in patch units
    num_tokens: int  # merged vision tokens
    timestamps: tuple[float, ...] = ()  # video: seconds of each temporal pair

    @property
    def nbytes(self) -> int:
        return int(self.patches.nbytes)


@attrs.frozen
class MediaBudgets:
    max_source_bytes: int = MAX_SOURCE_BYTES
    max_raw_patches: int = MAX_RAW_PATCHES
    max_vision_tokens: int = MAX_VISION_TOKENS

    @classmethod
    def for_context(cls, max_context: int) -> "MediaBudgets":
        """serving.md: Vision prompts are capped at min(--max-context, 32768) merged tokens."""
        return cls(max_vision_tokens=min(max_context, MAX_VISION_TOKENS))


@attrs.define(eq=False)
class PreparedMedia:
    """A request's prepared items, in request order, each holding one cache reference until `release`."""

    items: list[MediaItem]
    handles: list[MediaHandle]
    acquired_bytes: int
    seconds: float

    @property
    def payloads(self) -> list[PreparedPayload]:
        return [handle.payload for handle in self.handles]

    @property
    def vision_tokens(self) -> int:
        return sum(payload.num_tokens for payload in self.payloads)

    @property
    def digests(self) -> list[str]:
        """SHA-256 (hex) of each item's acquired bytes, in request order (the items' identity for prefix reuse)."""
        return [handle.key.digest for handle in self.handles]

    @property
    def payload_bytes(self) -> int:
        """The bf16 payload bytes this request references (shared payloads counted once per item)."""
        return sum(handle.nbytes for handle in self.handles)

    @property
    def cache_hits(self) -> int:
        """Items found live in the cache."""
        return sum(1 for handle in self.handles if handle.hit)

    @property
    def joined_builds(self) -> int:
        """Items that shared another request's identical build in flight (single-flight)."""
        return sum(1 for handle in self.handles if handle.joined and not handle.hit)

    @property
    def cache_misses(self) -> int:
        """Items this request built itself."""
        return sum(1 for handle in self.handles if not handle.hit and not handle.joined)

    def release(self) -> None:
        for handle in self.handles:
            if not handle.released:
                handle.release()

    def __enter__(self) -> "PreparedMedia":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def pool_threads(requested: int) -> int:
    """--media-preprocess-threads: N workers, or with 0 at most 16 chosen from the host's concurrency."""
    if requested < 0:
        raise ValueError(f"--media-preprocess-threads must be >= 0, got {requested}")
    return requested or max(1, min(MAX_POOL_THREADS, os.cpu_count() or 1))


class MediaPreparer:
    def __init__(self, cache: PreparedMediaCache, *, threads: int = 0, acquire_limits: AcquireLimits | None = None,
                 image_config: ImagePreprocessConfig | None = None,
                 video_config: VideoPreprocessConfig | None = None, video_budget: VideoBudget | None = None,
                 budgets: MediaBudgets | None = None) -> None:
        self._cache = cache
        self._pool = ThreadPoolExecutor(max_workers=pool_threads(threads), thread_name_prefix="media")
        self._limits = acquire_limits or AcquireLimits()
        self._image = image_config or ImagePreprocessConfig()
        self._video = video_config or VideoPreprocessConfig()
        self._video_budget = video_budget or VideoBudget()
        self.budgets = budgets or MediaBudgets()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def prepare(self, items: Sequence[MediaItem], *, deadline: float | None = None) -> PreparedMedia:
        """Prepare every item (blocking; call from a worker thread). Raises a MediaError subclass (status/code on
        the acquisition and budget errors), `MediaWaitTimeout` when the gate outlasts `deadline` (time.monotonic)."""
        began = time.perf_counter()
        acquired = list(self._pool.map(lambda item: acquire(item.url, self._limits, deadline=deadline), items))
        total = sum(media.size for media in acquired)
        if total > self.budgets.max_source_bytes:
            raise MediaBudgetExceeded(f"the request's media total {total} bytes, over the "
                                      f"{self.budgets.max_source_bytes}-byte budget")
        keys = [MediaKey(media.sha256, item.modality) for item, media in zip(items, acquired)]
        # Pin what is live now, so it cannot be evicted between this check and its use; reserve for the rest.
        pins = {key: self._cache.lookup(key) for key in dict.fromkeys(keys)}
        misses = {key: (item, media) for key, item, media in zip(keys, items, acquired) if pins[key] is None}
        reserve = sum(self._payload_bound(item.modality, media) for item, media in misses.values())
        handles: list[MediaHandle] = []
        try:
            with self._cache.reserve(reserve, deadline=deadline) as permit:
                futures = [self._pool.submit(self._cache.get_or_prepare, key, self._builder(item, media),
                                             permit=permit, deadline=deadline)
                           for key, item, media in zip(keys, items, acquired)]
                for future in futures:
                    handles.append(future.result())
            prepared = PreparedMedia(list(items), handles, total, time.perf_counter() - began)
            self._check_budgets(prepared)
        except BaseException:
            for handle in handles:
                handle.release()
            raise
        finally:
            for pin in pins.values():
                if pin is not None:
                    pin.release()
        return prepared

    # ---- internals ----

    def _builder(self, item: MediaItem, media: AcquiredMedia):
        def build() -> PreparedPayload:
            if item.modality == "image":
                image = preprocess_image(media.data, self._image)
                return PreparedPayload(f32_to_bf16_bits(image.patches), image.grid, image.num_tokens)
            video = preprocess_video(media.data, self._video, self._video_budget)
            return PreparedPayload(f32_to_bf16_bits(video.patches), video.grid, video.num_tokens,
                                   tuple(video.timestamps))

        return build

    def _payload_bound(self, modality: str, media: AcquiredMedia) -> int:
        """Bytes to reserve for a miss, from the file's header: exact for an image, and for a video whose header
        counts its frames; the configured volume ceiling otherwise (unused bytes go back when the permit closes)."""
        if modality == "image":
            cfg = self._image
            try:  # the header alone gives the size (an EXIF rotation swaps the sides, not the area)
                width, height = Image.open(io.BytesIO(media.data)).size
            except Exception as exc:
                raise ImageDecodeError(f"cannot decode image: {type(exc).__name__}: {exc}") from exc
            h, w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
            return (h // cfg.patch_size) * (w // cfg.patch_size) * cfg.row_size * 2
        cfg = self._video
        header = read_header(media.data)
        if header.total_frames <= 0:
            return (cfg.max_pixels // (cfg.patch_size * cfg.patch_size)) * cfg.row_size * 2
        frames = len(sample_frame_indices(header.total_frames, header.fps, cfg))
        t, h, w = video_grid(frames, header.height, header.width, cfg)
        return t * h * w * cfg.row_size * 2

    def _check_budgets(self, prepared: PreparedMedia) -> None:
        patches = sum(payload.patches.shape[0] for payload in prepared.payloads)
        if patches > self.budgets.max_raw_patches:
            raise MediaBudgetExceeded(f"the request's media make {patches} raw patches, over the "
                                      f"{self.budgets.max_raw_patches} the Vision runtime takes")
        if prepared.vision_tokens > self.budgets.max_vision_tokens:
            raise MediaBudgetExceeded(f"the request's media make {prepared.vision_tokens} vision tokens, over the "
                                      f"{self.budgets.max_vision_tokens} allowed (min(--max-context, 32768))")
