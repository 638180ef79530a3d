"""Video decoding (PyAV), frame sampling, smart resize over the frame volume and patch packing (facts §5.5, §3.11).

Mirrors transformers' ``Qwen3VLVideoProcessor`` (the class the official ``video_preprocessor_config.json`` names)
plus ``Qwen3VLProcessor.replace_video_token``:

* Sampling: ``n = clamp(int(total / src_fps * fps), min_frames, min(max_frames, total))`` frames at
  ``round(linspace(0, total - 1, n))`` (numpy round-half-even).
* Smart resize over the ``frames x h x w`` volume (factor ``patch * merge`` = 32, temporal factor 2, the frame
  count rounded half-even to a multiple of 2 for the comparison, the raw count in ``beta``; frames smaller than the
  factor are first scaled up), bounds ``size.shortest_edge`` / ``size.longest_edge`` of the config.
* Resize: the torchvision path transformers takes on x86 CPUs, i.e. torch's native uint8 antialiased bicubic
  (Keys a=-0.5, Pillow-SIMD style int16 fixed-point weights with per-axis precision, horizontal pass first,
  uint8-saturated intermediate).  Ported to numpy here, bit-exact; torch is not a run-time dependency.
* Fused rescale/normalize: ``(x - mean/rescale) / (std/rescale)`` in float32 (``(x - 127.5) / 127.5``).
* An odd frame count duplicates the last frame; rows ``[3][2][16][16]`` per temporal pair, pairs in order, each
  pair's rows in merge-block order (same as images).  Grid ``(ceil(n/2), h'/16, w'/16)``.
* Timestamp of pair t: ``(idx[2t]/fps + idx[2t+1]/fps) / 2`` (the padded index list), rendered ``<{ts:.1f} seconds>``.

Budgets (facts §4.2) raise :class:`MediaBudgetExceeded` (``code == "media_budget_exceeded"``).
"""

from __future__ import annotations

import io
import json
import math
import os
import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ninfer.media.image import (
    MAX_ASPECT_RATIO,
    MERGE_SIZE,
    PATCH_SIZE,
    TEMPORAL_PATCH_SIZE,
    AspectRatioError,
    ImagePreprocessConfig,
)
from ninfer.media.errors import MediaBudgetExceeded, MediaError

VIDEO_MIN_PIXELS = 4096
VIDEO_MAX_PIXELS = 25_165_824
VIDEO_FPS = 2.0
MIN_FRAMES = 4
MAX_FRAMES = 768
MAX_VIDEO_TOKENS = 768

MAX_SOURCE_FRAMES = 100_000
MAX_DURATION_S = 600.0
MAX_DECODED_PIXELS = 128 * 1024 * 1024
DEFAULT_FPS_FALLBACK = 24.0  # transformers' default when a stream reports no frame rate


class VideoDecodeError(MediaError):
    """The bytes are not a decodable video (no video stream, corrupt data, no frames)."""

    code = "invalid_media"


@dataclass(frozen=True)
class VideoPreprocessConfig(ImagePreprocessConfig):
    """The image processor's fields (patching, normalisation) plus video sampling; pixel limits apply to the whole
    frames x height x width volume."""

    min_pixels: int = VIDEO_MIN_PIXELS  # size.shortest_edge: minimum pixels of the whole volume
    max_pixels: int = VIDEO_MAX_PIXELS  # size.longest_edge: maximum pixels of the whole volume
    fps: float = VIDEO_FPS
    min_frames: int = MIN_FRAMES
    max_frames: int = MAX_FRAMES
    cap_pixels_per_frame: bool = False  # transformers 5.x default (None -> False)
    max_video_tokens: int = MAX_VIDEO_TOKENS

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "VideoPreprocessConfig":
        # The patching and normalisation fields read as the image processor's; the pixel limits prefer `size`.
        fields = dataclasses.asdict(ImagePreprocessConfig.from_dict(d))
        size = d.get("size") or {}
        fields.update(min_pixels=int(size.get("shortest_edge", d.get("min_pixels", VIDEO_MIN_PIXELS))),
                      max_pixels=int(size.get("longest_edge", d.get("max_pixels", VIDEO_MAX_PIXELS))))
        return cls(**fields, fps=float(d.get("fps", VIDEO_FPS)), min_frames=int(d.get("min_frames", MIN_FRAMES)),
                   max_frames=int(d.get("max_frames", MAX_FRAMES)),
                   cap_pixels_per_frame=bool(d.get("cap_pixels_per_frame") or False),
                   max_video_tokens=int(d.get("max_video_tokens", MAX_VIDEO_TOKENS)))

    @classmethod
    def from_json(cls, source: "str | os.PathLike[str] | Mapping[str, Any]") -> "VideoPreprocessConfig":
        """``source``: a path to video_preprocessor_config.json, its JSON text, or the parsed mapping."""
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        if isinstance(source, str) and source.lstrip().startswith("{"):
            return cls.from_dict(json.loads(source))
        with open(source, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    from_file = from_json


@dataclass(frozen=True)
class VideoBudget:
    max_source_frames: int = MAX_SOURCE_FRAMES
    max_duration_s: float = MAX_DURATION_S
    max_decoded_pixels: int = MAX_DECODED_PIXELS  # sampled frames x height x width
    max_aspect_ratio: float = MAX_ASPECT_RATIO


@dataclass(frozen=True)
class DecodedVideo:
    frames: np.ndarray  # [n, H, W, 3] uint8 RGB, the sampled frames (all frames when sampling is off)
    frame_indices: tuple[int, ...]  # source index of each row of ``frames``
    fps: float  # source frames per second
    total_frames: int  # source frame count
    width: int
    height: int

    @property
    def duration(self) -> float:
        return self.total_frames / self.fps if self.fps else 0.0


@dataclass(frozen=True)
class ProcessedVideo:
    patches: np.ndarray  # [t*h*w, 3*temporal*p*p] float32, rows per temporal pair
    grid: tuple[int, int, int]  # (t, h, w) in patch units
    timestamps: tuple[float, ...]  # seconds, one per temporal pair
    frame_indices: tuple[int, ...]  # sampled source indices (before odd-count padding)
    merge_size: int = MERGE_SIZE

    @property
    def tokens_per_frame(self) -> int:
        _, h, w = self.grid
        return h * w // (self.merge_size * self.merge_size)

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.tokens_per_frame


# ----------------------------------------------------------------------------------------------- sampling / sizes


def sample_frame_indices(
    total_frames: int, src_fps: float | None, config: VideoPreprocessConfig | None = None
) -> np.ndarray:
    """Indices of the sampled frames (``Qwen3VLVideoProcessor.sample_frames`` with the config's ``fps``)."""
    cfg = config or VideoPreprocessConfig()
    if total_frames <= 0:
        raise VideoDecodeError("video has no frames")
    fps = float(src_fps) if src_fps else DEFAULT_FPS_FALLBACK
    n = int(total_frames / fps * cfg.fps)
    n = min(max(n, cfg.min_frames), cfg.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, n).round().astype(np.int64)


def video_smart_resize(
    num_frames: int,
    height: int,
    width: int,
    temporal_factor: int = TEMPORAL_PATCH_SIZE,
    factor: int = PATCH_SIZE * MERGE_SIZE,
    min_pixels: int = VIDEO_MIN_PIXELS,
    max_pixels: int = VIDEO_MAX_PIXELS,
) -> tuple[int, int]:
    """Target (height, width) of every frame (transformers' qwen3_vl ``smart_resize``).

    A single frame is treated as its temporal pair (transformers raises for ``num_frames < temporal_factor``)."""
    num_frames = max(int(num_frames), temporal_factor)
    if height <= 0 or width <= 0:
        raise AspectRatioError(f"video dimensions must be positive, got {height}x{width}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height = int(height * scale)
        width = int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise AspectRatioError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
            f"got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _volume_max_pixels(num_frames: int, cfg: VideoPreprocessConfig) -> int:
    if not cfg.cap_pixels_per_frame:
        return cfg.max_pixels
    frame_cap = cfg.max_video_tokens * cfg.factor * cfg.factor
    per_frame = max(min(frame_cap, cfg.max_pixels // num_frames), int(cfg.min_pixels * 1.05))
    return per_frame * num_frames


def video_target_size(
    num_frames: int, height: int, width: int, config: VideoPreprocessConfig | None = None
) -> tuple[int, int]:
    """Resized (height, width) of every frame for ``num_frames`` sampled frames."""
    cfg = config or VideoPreprocessConfig()
    return video_smart_resize(
        num_frames, height, width, cfg.temporal_patch_size, cfg.factor, cfg.min_pixels,
        _volume_max_pixels(max(num_frames, cfg.temporal_patch_size), cfg),
    )


def video_grid(
    num_frames: int, height: int, width: int, config: VideoPreprocessConfig | None = None
) -> tuple[int, int, int]:
    """Grid (t, h, w) for ``num_frames`` sampled frames of a ``height x width`` video."""
    cfg = config or VideoPreprocessConfig()
    rh, rw = video_target_size(num_frames, height, width, cfg)
    t = -(-max(num_frames, 1) // cfg.temporal_patch_size)
    return t, rh // cfg.patch_size, rw // cfg.patch_size


def pair_timestamps(frame_indices, src_fps: float, temporal_patch_size: int = TEMPORAL_PATCH_SIZE) -> list[float]:
    """Seconds per temporal pair (``Qwen3VLProcessor._calculate_timestamps``)."""
    idx = [int(i) for i in frame_indices]
    if idx and len(idx) % temporal_patch_size:
        idx.extend(idx[-1] for _ in range(temporal_patch_size - len(idx) % temporal_patch_size))
    ts = [i / src_fps for i in idx]
    return [(ts[i] + ts[i + temporal_patch_size - 1]) / 2 for i in range(0, len(ts), temporal_patch_size)]


# ----------------------------------------------------------------------------------------------- resize


def _cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    x = np.abs(x)
    c1 = ((a + 2) * x - (a + 3)) * x * x + 1
    c2 = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1.0, c1, np.where(x < 2.0, c2, 0.0))


def _aa_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """torch's antialiased bicubic taps for one axis: indices [out, K], int16-range weights [out, K], precision."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
    xmin = np.maximum(np.trunc(center - support + 0.5).astype(np.int64), 0)
    xmax = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size)
    xsize = xmax - xmin
    k = int(xsize.max())
    j = np.arange(k, dtype=np.int64)
    valid = j[None, :] < xsize[:, None]
    w = _cubic(((j[None, :] + xmin[:, None]) - center[:, None] + 0.5) * invscale)
    w = np.where(valid, w, 0.0)
    total = w.sum(axis=1, keepdims=True)  # sequential sums in torch; K is small, the int16 rounding absorbs it
    w = np.where(total != 0.0, w / np.where(total != 0.0, total, 1.0), 0.0)
    wmax = float(np.abs(w).max())
    prec = 0
    while prec < 22 and int(0.5 + wmax * (1 << (prec + 1))) < (1 << 15):
        prec += 1
    v = w * (1 << prec)
    wi = np.where(v < 0, np.trunc(v - 0.5), np.trunc(v + 0.5)).astype(np.int32)
    idx = np.where(valid, xmin[:, None] + j[None, :], xmin[:, None])
    return idx, wi, prec


_CHUNK = 32  # output samples per dense block of the banded resampling matrix


def _resample_rows(x: np.ndarray, idx: np.ndarray, w: np.ndarray, prec: int, left: bool) -> np.ndarray:
    """Banded fixed-point resampling as blocked dense matmuls (BLAS).  Every product and partial sum is an integer
    below 2**24 (float32) or 2**53 (float64), so the result equals torch's int32 accumulation exactly.

    ``left``: ``x`` is ``[B, in, M]`` and the output ``[B, out, M]``; else ``x`` is ``[R, in]`` and the output
    ``[R, out]``."""
    out_size = idx.shape[0]
    bound = 255 * int(np.abs(w).sum(axis=1).max()) + (1 << prec)
    dtype = np.float32 if bound < (1 << 24) else np.float64
    xf = x.astype(dtype)
    if left:
        y = np.empty((x.shape[0], out_size, x.shape[2]), dtype=dtype)
    else:
        y = np.empty((x.shape[0], out_size), dtype=dtype)
    for o0 in range(0, out_size, _CHUNK):
        o1 = min(o0 + _CHUNK, out_size)
        ci, cw = idx[o0:o1], w[o0:o1]
        lo, hi = int(ci.min()), int(ci.max()) + 1
        dense = np.zeros((o1 - o0, hi - lo), dtype=dtype)
        np.add.at(dense, (np.arange(o1 - o0)[:, None], ci - lo), cw)  # padded taps carry weight 0
        if left:
            y[:, o0:o1, :] = np.matmul(dense, xf[:, lo:hi, :])
        else:
            y[:, o0:o1] = xf[:, lo:hi] @ dense.T
    y += 1 << (prec - 1)
    y *= 1.0 / (1 << prec)  # exact: a power of two
    np.floor(y, out=y)  # arithmetic shift
    np.clip(y, 0, 255, out=y)
    return y.astype(np.uint8)


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """``[n, H, W, C]`` uint8 -> ``[n, height, width, C]`` uint8, antialiased bicubic exactly as torch's uint8 CPU
    kernel (what torchvision's ``resize`` runs for transformers' video processor): width pass, then height pass."""
    x = np.asarray(frames, dtype=np.uint8)
    n, h, w, c = x.shape
    if w != width:
        idx, wt, prec = _aa_weights(w, width)
        rows = x.transpose(0, 1, 3, 2).reshape(n * h * c, w)
        x = _resample_rows(rows, idx, wt, prec, left=False).reshape(n, h, c, width).transpose(0, 1, 3, 2)
        w = width
    if h != height:
        idx, wt, prec = _aa_weights(h, height)
        x = _resample_rows(np.ascontiguousarray(x).reshape(n, h, w * c), idx, wt, prec, left=True)
        x = x.reshape(n, height, w, c)
    return np.ascontiguousarray(x)


# ----------------------------------------------------------------------------------------------- packing


def pack_video_patches(
    pixels: np.ndarray,
    patch_size: int = PATCH_SIZE,
    temporal_patch_size: int = TEMPORAL_PATCH_SIZE,
    merge_size: int = MERGE_SIZE,
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``pixels`` ``[T, C, H, W]`` float32 -> rows ``[gt*gh*gw, C*temporal*p*p]`` and grid; an odd T repeats the
    last frame.  Row order as transformers' ``Qwen3VLVideoProcessor.patchify``."""
    t, c, height, width = pixels.shape
    if pad := -t % temporal_patch_size:
        pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, axis=0)], axis=0)
        t += pad
    gt = t // temporal_patch_size
    gh, gw = height // patch_size, width // patch_size
    if gh * patch_size != height or gw * patch_size != width or gh % merge_size or gw % merge_size:
        raise MediaError(f"{height}x{width} is not a multiple of patch*merge = {patch_size * merge_size}")
    m = merge_size
    x = pixels.reshape(gt, temporal_patch_size, c, gh // m, m, patch_size, gw // m, m, patch_size)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (gt, bh, bw, mh, mw, C, tp, ph, pw)
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(gt * gh * gw, c * temporal_patch_size * patch_size**2)
    return rows, (gt, gh, gw)


def _normalize(frames_u8: np.ndarray, cfg: VideoPreprocessConfig) -> np.ndarray:
    """``[n, H, W, 3]`` uint8 -> ``[n, 3, H, W]`` float32 with the fused rescale+normalize of the torch backend."""
    inv = np.float32(1.0 / cfg.rescale_factor)
    mean = (np.asarray(cfg.image_mean, dtype=np.float32) * inv).reshape(1, 3, 1, 1)
    std = (np.asarray(cfg.image_std, dtype=np.float32) * inv).reshape(1, 3, 1, 1)
    x = frames_u8.transpose(0, 3, 1, 2).astype(np.float32)
    x -= mean
    x /= std
    return x


# ----------------------------------------------------------------------------------------------- decode


def _check_source_budget(total: int, fps: float, height: int, width: int, budget: VideoBudget) -> None:
    if total > budget.max_source_frames:
        raise MediaBudgetExceeded(f"video has {total} frames, more than {budget.max_source_frames}")
    duration = total / fps if fps else 0.0
    if duration > budget.max_duration_s:
        raise MediaBudgetExceeded(f"video lasts {duration:.1f} s, more than {budget.max_duration_s:g} s")
    if height <= 0 or width <= 0:
        raise VideoDecodeError(f"video has invalid dimensions {width}x{height}")
    if max(height, width) / min(height, width) > budget.max_aspect_ratio:
        ratio = max(height, width) / min(height, width)
        raise MediaBudgetExceeded(f"video aspect ratio {ratio:.1f} exceeds {budget.max_aspect_ratio:g}")


def _open(data: bytes):
    import av  # PyAV: a project dependency, imported lazily so text-only serving does not load FFmpeg

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except Exception as e:  # av.error.FFmpegError and friends
        raise VideoDecodeError(f"cannot open video: {type(e).__name__}: {e}") from e
    if not container.streams.video:
        container.close()
        raise VideoDecodeError("no video stream")
    return container


def _count_frames(data: bytes, budget: VideoBudget) -> int:
    container = _open(data)
    try:
        n = 0
        for _ in container.decode(video=0):
            n += 1
            if n > budget.max_source_frames:
                raise MediaBudgetExceeded(f"video has more than {budget.max_source_frames} frames")
        return n
    except MediaError:
        raise
    except Exception as e:
        raise VideoDecodeError(f"cannot decode video: {type(e).__name__}: {e}") from e
    finally:
        container.close()


@dataclass(frozen=True)
class VideoHeader:
    """What the container says before any frame is decoded."""

    total_frames: int  # 0 when the header has no count (Matroska/WebM, raw streams)
    fps: float
    height: int
    width: int
    declared_s: float  # the container's duration, 0 when unknown


def read_header(data: bytes | bytearray | memoryview) -> VideoHeader:
    container = _open(bytes(data))
    try:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else DEFAULT_FPS_FALLBACK
        total = int(stream.frames or 0)
        height, width = int(stream.codec_context.height), int(stream.codec_context.width)
        declared_s = container.duration / 1_000_000 if container.duration else 0.0  # AV_TIME_BASE units
    finally:
        container.close()
    if fps <= 0 or not math.isfinite(fps):
        fps = DEFAULT_FPS_FALLBACK
    return VideoHeader(total, fps, height, width, declared_s)


def decode_video(
    data: bytes | bytearray | memoryview,
    config: VideoPreprocessConfig | None = None,
    budget: VideoBudget | None = None,
    *,
    sample: bool = True,
) -> DecodedVideo:
    """Decode a video with PyAV and keep the sampled frames as RGB uint8 (all frames with ``sample=False``).

    The frame count is the stream's header count (as transformers' PyAV reader), or a decode count when the header
    has none or overstates it.  Budgets are checked before any frame is converted to RGB."""
    cfg = config or VideoPreprocessConfig()
    bud = budget or VideoBudget()
    raw = bytes(data)
    header = read_header(raw)
    total, fps, height, width, declared_s = (header.total_frames, header.fps, header.height, header.width,
                                             header.declared_s)
    if total > bud.max_source_frames:
        raise MediaBudgetExceeded(f"video has {total} frames, more than {bud.max_source_frames}")
    if total <= 0:  # no frame count in the header (Matroska/WebM, raw streams): count by decoding
        if declared_s > bud.max_duration_s:
            raise MediaBudgetExceeded(f"video lasts {declared_s:.1f} s, more than {bud.max_duration_s:g} s")
        total = _count_frames(raw, bud)
    for _attempt in range(2):
        if total <= 0:
            raise VideoDecodeError("video has no frames")
        _check_source_budget(total, fps, height, width, bud)
        indices = sample_frame_indices(total, fps, cfg) if sample else np.arange(total, dtype=np.int64)
        if len(indices) * height * width > bud.max_decoded_pixels:
            raise MediaBudgetExceeded(
                f"decoded video would hold {len(indices) * height * width} pixels, more than {bud.max_decoded_pixels}"
            )
        wanted = {int(i): k for k, i in enumerate(indices.tolist())}
        last = int(indices[-1])
        frames: list[np.ndarray | None] = [None] * len(indices)
        seen = 0
        container = _open(raw)
        try:
            for i, frame in enumerate(container.decode(video=0)):
                seen = i + 1
                if i in wanted:
                    if frame.height != height or frame.width != width:
                        height, width = int(frame.height), int(frame.width)
                        _check_source_budget(total, fps, height, width, bud)
                        if len(indices) * height * width > bud.max_decoded_pixels:
                            raise MediaBudgetExceeded("decoded video exceeds the pixel budget")
                    frames[wanted[i]] = frame.to_ndarray(format="rgb24")
                if i >= last:
                    break
        except MediaError:
            raise
        except Exception as e:
            raise VideoDecodeError(f"cannot decode video: {type(e).__name__}: {e}") from e
        finally:
            container.close()
        if all(f is not None for f in frames):
            if len({f.shape for f in frames}) != 1:  # type: ignore[union-attr]
                raise VideoDecodeError("video frames change size mid-stream")
            return DecodedVideo(
                frames=np.stack(frames),  # type: ignore[arg-type]
                frame_indices=tuple(int(i) for i in indices),
                fps=fps,
                total_frames=total,
                width=width,
                height=height,
            )
        total = seen  # the header overstated the frame count: sample again over the frames that exist
    raise VideoDecodeError("video frame count is inconsistent")


def preprocess_frames(
    frames: np.ndarray,
    frame_indices,
    src_fps: float,
    config: VideoPreprocessConfig | None = None,
) -> ProcessedVideo:
    """Sampled RGB uint8 frames ``[n, H, W, 3]`` -> ``ProcessedVideo`` (resize, normalize, pack, timestamps)."""
    cfg = config or VideoPreprocessConfig()
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or frames.shape[0] == 0:
        raise MediaError(f"expected [n, H, W, 3] uint8 frames, got {frames.shape} {frames.dtype}")
    n, height, width, _ = frames.shape
    rh, rw = video_target_size(n, height, width, cfg)
    resized = resize_frames(frames, rh, rw)
    rows, grid = pack_video_patches(_normalize(resized, cfg), cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size)
    return ProcessedVideo(
        patches=rows,
        grid=grid,
        timestamps=tuple(pair_timestamps(frame_indices, src_fps, cfg.temporal_patch_size)),
        frame_indices=tuple(int(i) for i in frame_indices),
        merge_size=cfg.merge_size,
    )


def preprocess_video(
    video: "DecodedVideo | bytes | bytearray | memoryview",
    config: VideoPreprocessConfig | None = None,
    budget: VideoBudget | None = None,
) -> ProcessedVideo:
    """Bytes or a ``DecodedVideo`` -> ``ProcessedVideo`` (float32 rows, grid, per-pair timestamps)."""
    cfg = config or VideoPreprocessConfig()
    if not isinstance(video, DecodedVideo):
        video = decode_video(video, cfg, budget)
    return preprocess_frames(video.frames, video.frame_indices, video.fps, cfg)


def timestamp_text(seconds: float) -> str:
    return f"<{seconds:.1f} seconds>"
