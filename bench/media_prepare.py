"""Media preparation throughput on this machine's CPUs (the Vision issue's figures).

* images/s: distinct 1024x1024 PNGs (so every one is a cache miss) through MediaPreparer with --media-preprocess-
  threads 0 (all cores), one item per request, several requests in flight;
* video frames/s: sampled frames processed per second for a 10 s 640x480 30 fps H.264 video (all cores);
* cache hit latency: a request whose only item is already prepared (acquire + SHA-256 + lookup).

Run: `python bench/media_prepare.py`; JSON to bench/results/media_prepare.json.
"""

from __future__ import annotations

import base64
import io
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import av
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.media.cache import PreparedMediaCache  # noqa: E402
from ninfer.media.prepare import MediaItem, MediaPreparer, pool_threads  # noqa: E402

MIB = 1 << 20


def png_url(seed: int, size: int = 1024) -> str:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size]
    base = 127 + 100 * np.sin(yy / 37.0 + seed)[..., None] * np.cos(xx / 23.0)[..., None]
    pixels = np.clip(base + rng.integers(-20, 21, (size, size, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def video_url(seconds: int = 10, fps: int = 30, height: int = 480, width: int = 640) -> str:
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast"}
        yy, xx = np.mgrid[0:height, 0:width]
        for i in range(seconds * fps):
            frame = (127 + 100 * np.sin((yy + 3 * i) / 17.0)[..., None] * np.cos((xx - 2 * i) / 13.0)[..., None])
            image = np.repeat(frame, 3, axis=2).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return "data:video/mp4;base64," + base64.b64encode(out.getvalue()).decode()


def main() -> None:
    threads = pool_threads(0)
    cache = PreparedMediaCache(cache_bytes=1024 * MIB, live_bytes=2048 * MIB)
    preparer = MediaPreparer(cache, threads=threads)
    images = [png_url(seed) for seed in range(24)]

    def one(url: str) -> int:
        with preparer.prepare([MediaItem("image", url)]) as prepared:
            return prepared.vision_tokens

    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as requests:
        tokens = list(requests.map(one, images))
    image_seconds = time.perf_counter() - began

    hits = []
    for url in images[:8]:
        start = time.perf_counter()
        one(url)
        hits.append(time.perf_counter() - start)

    video = video_url()
    start = time.perf_counter()
    with preparer.prepare([MediaItem("video", video)]) as prepared:
        payload = prepared.payloads[0]
    video_seconds = time.perf_counter() - start
    sampled = payload.grid[0] * 2
    preparer.close()
    report = {
        "cpu_count": os.cpu_count(), "threads": threads,
        "images": {"count": len(images), "size": "1024x1024 PNG", "tokens_each": tokens[0],
                   "seconds": image_seconds, "images_per_s": len(images) / image_seconds},
        "cache_hit_ms": {"median": statistics.median(hits) * 1e3, "max": max(hits) * 1e3,
                         "note": "a 1024x1024 PNG data URL: base64 decode + SHA-256 + lookup"},
        "video": {"source": "10 s, 640x480, 30 fps H.264", "sampled_frames": sampled, "grid": payload.grid,
                  "tokens": payload.num_tokens, "seconds": video_seconds, "frames_per_s": sampled / video_seconds},
    }
    print(json.dumps(report, indent=1))
    out = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "media_prepare.json"
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
