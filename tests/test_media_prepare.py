"""Request media preparation: acquisition, the shared cache (hits, single builds), BF16 payloads equal to the
processors' rows, the request budgets, and no reference left behind on any failure."""

from __future__ import annotations

import base64
import io
import threading

import numpy as np
import pytest
from PIL import Image

from ninfer.artifact.codec import f32_to_bf16_bits
from ninfer.media.cache import PreparedMediaCache
from ninfer.media.errors import MediaBudgetExceeded, MediaError
from ninfer.media.image import preprocess_image
from ninfer.media.prepare import MediaBudgets, MediaItem, MediaPreparer, pool_threads
from ninfer.media.video import preprocess_video
from tests.test_media_video import _make_video

MIB = 1 << 20


def png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@pytest.fixture
def preparer():
    cache = PreparedMediaCache(cache_bytes=64 * MIB, live_bytes=256 * MIB)
    prep = MediaPreparer(cache, threads=2)
    yield prep
    prep.close()


def test_image_and_video_payloads_are_the_processors_rows_in_bf16(preparer):
    image, video = png(100, 60), _make_video(12, 64, 96, 4)
    items = [MediaItem("image", data_url(image, "image/png")), MediaItem("video", data_url(video, "video/mp4"))]
    with preparer.prepare(items) as prepared:
        first, second = prepared.payloads
        want_image, want_video = preprocess_image(image), preprocess_video(video)
        assert np.array_equal(first.patches, f32_to_bf16_bits(want_image.patches))
        assert (first.grid, first.num_tokens, first.timestamps) == (want_image.grid, want_image.num_tokens, ())
        assert np.array_equal(second.patches, f32_to_bf16_bits(want_video.patches))
        assert (second.grid, second.num_tokens) == (want_video.grid, want_video.num_tokens)
        assert second.timestamps == tuple(want_video.timestamps)
        assert prepared.vision_tokens == want_image.num_tokens + want_video.num_tokens
        assert prepared.acquired_bytes == len(image) + len(video)


def test_repeated_media_is_built_once_and_hit_later(preparer):
    url = data_url(png(64, 64, seed=3), "image/png")
    with preparer.prepare([MediaItem("image", url)] * 3) as prepared:
        assert len({id(p) for p in prepared.payloads}) == 1  # one build, three references
    stats = preparer._cache.stats()
    assert stats.misses == 1 and stats.hits + stats.single_flight_joins == 2 and stats.open_handles == 0
    with preparer.prepare([MediaItem("image", url)]):
        after = preparer._cache.stats()
        assert after.misses == 1 and after.hits > stats.hits  # served from the cache, not rebuilt
    # The same bytes as a video are another entry (the modality is part of the key).
    assert MediaItem("image", url) != MediaItem("video", url)


def test_request_budgets_reject_and_release_everything():
    cache = PreparedMediaCache(cache_bytes=64 * MIB, live_bytes=256 * MIB)
    items = [MediaItem("image", data_url(png(400, 300, seed=i), "image/png")) for i in range(2)]
    tight_patches = MediaPreparer(cache, threads=2, budgets=MediaBudgets(max_raw_patches=500))
    with pytest.raises(MediaBudgetExceeded, match="raw patches") as info:
        tight_patches.prepare(items)
    assert (info.value.status, info.value.code) == (400, "media_budget_exceeded")
    tight_tokens = MediaPreparer(cache, threads=2, budgets=MediaBudgets.for_context(100))
    with pytest.raises(MediaBudgetExceeded, match="vision tokens"):
        tight_tokens.prepare(items)
    tight_bytes = MediaPreparer(cache, threads=2, budgets=MediaBudgets(max_source_bytes=1000))
    with pytest.raises(MediaBudgetExceeded, match="bytes"):
        tight_bytes.prepare(items)
    stats = cache.stats()
    assert stats.open_handles == 0 and stats.open_permits == 0 and stats.reserved_bytes == 0
    for prep in (tight_patches, tight_tokens, tight_bytes):
        prep.close()


def test_bad_media_is_a_typed_error_and_leaves_nothing(preparer):
    good = MediaItem("image", data_url(png(32, 32), "image/png"))
    for bad in (MediaItem("image", data_url(b"not an image", "image/png")),
                MediaItem("video", data_url(b"not a video", "video/mp4")),
                MediaItem("image", "ftp://example.com/a.png")):
        with pytest.raises(MediaError):
            preparer.prepare([good, bad])
    stats = preparer._cache.stats()
    assert stats.open_handles == 0 and stats.reserved_bytes == 0 and stats.in_flight == 0
    with pytest.raises(ValueError, match="modality"):
        MediaItem("audio", "data:,")


def test_concurrent_requests_share_builds_under_a_small_live_limit():
    """Twelve requests of three images each (some shared) against room for about two requests at once."""
    images = [png(200, 160, seed=i) for i in range(5)]
    one_payload = f32_to_bf16_bits(preprocess_image(images[0]).patches).nbytes
    cache = PreparedMediaCache(cache_bytes=0, live_bytes=7 * one_payload)
    preparer = MediaPreparer(cache, threads=3)
    results, errors = [], []

    def request(i: int) -> None:
        items = [MediaItem("image", data_url(images[(i + j) % 5], "image/png")) for j in range(3)]
        try:
            with preparer.prepare(items, deadline=None) as prepared:
                results.append(sum(p.num_tokens for p in prepared.payloads))
        except Exception as exc:  # noqa: BLE001 - the test reports every failure
            errors.append(exc)

    threads = [threading.Thread(target=request, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    preparer.close()
    assert not errors and len(results) == 12
    stats = cache.stats()
    assert stats.live_bytes == 0 and stats.open_handles == 0 and stats.open_permits == 0


def test_pool_size_follows_the_option():
    assert pool_threads(3) == 3
    assert 1 <= pool_threads(0) <= 16
    with pytest.raises(ValueError):
        pool_threads(-1)
