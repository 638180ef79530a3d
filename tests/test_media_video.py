"""Video preprocessing parity with transformers' Qwen3VLVideoProcessor / Qwen3VLProcessor (the classes the official
Qwen3.6 video_preprocessor_config.json names).

torchvision is not installed, so the processor cannot be instantiated; the test drives its own pieces instead:
``read_video_pyav`` + ``Qwen3VLVideoProcessor.sample_frames`` (decode + sampling), qwen3_vl ``smart_resize``,
``get_num_of_video_patches``, ``patchify`` and ``Qwen3VLProcessor.replace_video_token``.  The one torchvision call of
the pipeline, ``tvF.resize(uint8, BICUBIC, antialias=True)``, is on x86 CPUs torch's native uint8 antialiased
kernel, i.e. ``F.interpolate(..., mode="bicubic", antialias=True)`` on the uint8 tensor; the fused
rescale/normalize is ``(x.float() - mean*255) / (std*255)``.  (Checked once by hand against the real
``AutoVideoProcessor`` + ``Qwen3VLProcessor`` with torchvision 0.28 installed: identical rows and input_ids.)
Tolerance: exact (max |diff| == 0 in float32)."""

from __future__ import annotations

import dataclasses
import functools
import io
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

av = pytest.importorskip("av")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers.models.qwen3_vl import processing_qwen3_vl as hf_proc  # noqa: E402
from transformers.video_utils import read_video_pyav  # noqa: E402


def _load_hf_video_processing():
    """transformers' lazy module hides video_processing_qwen3_vl behind a torchvision check; load the file itself
    (only its pure-Python/torch pieces are used)."""
    import importlib.util
    import sys

    import transformers

    name = "transformers.models.qwen3_vl._ninfer_test_video_processing"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(transformers.__file__).parent / "models" / "qwen3_vl" / "video_processing_qwen3_vl.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


hf_vp = _load_hf_video_processing()

from ninfer.media import MediaError  # noqa: E402
from ninfer.media.positions import (  # noqa: E402
    VIDEO_PAD_ID,
    VISION_END_ID,
    VISION_START_ID,
    PositionError,
    assign_positions,
    expand_video_placeholders,
    token_types,
    video_placeholder_ids,
)
from ninfer.media.video import (  # noqa: E402
    DecodedVideo,
    MediaBudgetExceeded,
    VideoBudget,
    VideoDecodeError,
    VideoPreprocessConfig,
    decode_video,
    pair_timestamps,
    preprocess_frames,
    preprocess_video,
    resize_frames,
    sample_frame_indices,
    video_grid,
    video_smart_resize,
)

FIXTURE = Path(__file__).parent / "fixtures" / "qwen" / "Qwen3.6-27B" / "video_preprocessor_config.json"
ATOL = 0.0


@pytest.fixture(scope="module")
def config() -> VideoPreprocessConfig:
    return VideoPreprocessConfig.from_json(FIXTURE)


def _hf_self(config: VideoPreprocessConfig):
    """Attributes the processor methods read (the fixture's values plus the class defaults). transformers >= 5.25
    reads them through `_merge_and_standardize_kwargs` (call kwargs over the instance's attributes), so the stand-in
    has that too."""
    import json

    raw = json.loads(FIXTURE.read_text())
    attributes = dict(
        fps=2, min_frames=4, max_frames=768, patch_size=raw["patch_size"],
        size={"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels},
        merge_size=raw["merge_size"], temporal_patch_size=raw["temporal_patch_size"], cap_pixels_per_frame=None,
        max_video_tokens=768,
    )
    return SimpleNamespace(**attributes, _merge_and_standardize_kwargs=lambda **kwargs: {**attributes, **kwargs})


def _make_video(n: int, h: int, w: int, fps: int | Fraction, codec: str = "libx264", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4" if codec != "ffv1" else "matroska") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = w, h
        stream.pix_fmt = "yuv444p" if codec == "libx264" else ("yuv420p" if codec == "mpeg4" else "bgr0")
        if codec == "libx264":
            stream.options = {"crf": "18", "preset": "ultrafast"}
        yy, xx = np.mgrid[0:h, 0:w]
        for i in range(n):
            base = 127 + 100 * np.sin((yy + 3 * i) / 7.0)[..., None] * np.cos((xx - 2 * i) / 5.0)[..., None]
            arr = np.clip(base + rng.integers(-40, 41, (h, w, 3)), 0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def _hf_reference(data: bytes, config: VideoPreprocessConfig):
    """transformers' pipeline on the same bytes: PyAV decode + sampling, resize, normalize, patchify, tokens."""
    fake = _hf_self(config)
    sample = functools.partial(hf_vp.Qwen3VLVideoProcessor.sample_frames, fake)
    frames, metadata = read_video_pyav(io.BytesIO(data), sample_indices_fn=sample)
    video = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()  # [T, C, H, W] uint8
    n, _, h, w = video.shape
    rh, rw = hf_vp.smart_resize(n, h, w, temporal_factor=2, factor=32,
                                min_pixels=config.min_pixels, max_pixels=config.max_pixels)
    if (rh, rw) != (h, w):
        video = torch.nn.functional.interpolate(video, size=(rh, rw), mode="bicubic", antialias=True)
    mean = torch.tensor([0.5, 0.5, 0.5]) * (1.0 / (1 / 255))
    std = torch.tensor([0.5, 0.5, 0.5]) * (1.0 / (1 / 255))
    x = video.to(torch.float32).sub_(mean[:, None, None]).div_(std[:, None, None])
    patches, gt, gh, gw = hf_vp.Qwen3VLVideoProcessor.patchify(None, x[None], 16, 2, 2)
    n_patches = hf_vp.Qwen3VLVideoProcessor.get_num_of_video_patches(fake, n, h, w)
    assert n_patches == gt * gh * gw
    proc = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2), video_token="<|video_pad|>",
        vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
    )
    proc._calculate_timestamps = functools.partial(hf_proc.Qwen3VLProcessor._calculate_timestamps, proc)
    grid = torch.tensor([[gt, gh, gw]])
    text = hf_proc.Qwen3VLProcessor.replace_video_token(proc, {"video_grid_thw": grid, "video_metadata": [metadata]}, 0)
    return SimpleNamespace(frames=frames, metadata=metadata, patches=patches[0].numpy(), grid=(gt, gh, gw), text=text)


# (frames, height, width, fps, volume max_pixels or None for the fixture's): odd and even sampled counts, up- and
# down-scaling, fractional fps, tiny frames
CASES = [
    (8, 48, 64, 4, None),        # 8 frames @4 fps -> 4 sampled, upscaled to the volume minimum
    (9, 36, 52, 3, None),        # 6 sampled
    (13, 64, 48, 2, None),       # 13 sampled (odd): last frame duplicated
    (40, 96, 160, 10, None),     # 8 sampled, 96x160 kept
    (25, 120, 90, Fraction(30000, 1001), None),  # NTSC rate, 4 sampled
    (21, 20, 300, 6, None),      # tiny height: scaled up before the factor rounding
    (17, 256, 320, 5, None),     # 6 sampled, already multiples of 32
    (11, 720, 1280, 1, None),    # 11 sampled (odd), 720 -> 704 by the factor rounding
    (16, 96, 160, 4, 60_000),    # volume over max_pixels: beta downscale
    (9, 300, 200, 3, 100_000),   # 6 sampled, strong downscale (antialiasing taps)
]


@pytest.mark.parametrize("n,h,w,fps,max_pixels", CASES)
def test_matches_hf(config, n, h, w, fps, max_pixels):
    if max_pixels is not None:
        config = dataclasses.replace(config, max_pixels=max_pixels)
    data = _make_video(n, h, w, fps, seed=n * 7 + h)
    ref = _hf_reference(data, config)
    dec = decode_video(data, config)
    assert dec.total_frames == ref.metadata.total_num_frames == n
    assert dec.fps == pytest.approx(float(ref.metadata.fps), abs=0)
    assert dec.duration == pytest.approx(ref.metadata.duration)
    assert list(dec.frame_indices) == [int(i) for i in ref.metadata.frames_indices]
    np.testing.assert_array_equal(dec.frames, ref.frames)
    out = preprocess_video(dec, config)
    assert out.grid == ref.grid == video_grid(len(dec.frame_indices), h, w, config)
    assert out.patches.dtype == np.float32 and out.patches.shape == ref.patches.shape
    assert out.patches.shape == (out.grid[0] * out.grid[1] * out.grid[2], 1536)
    assert float(np.max(np.abs(out.patches - ref.patches))) <= ATOL
    assert out.num_tokens == out.grid[0] * out.tokens_per_frame
    # expansion text equals the processor's replacement string
    ours = "".join(
        f"<{ts:.1f} seconds><|vision_start|>" + "<|video_pad|>" * out.tokens_per_frame + "<|vision_end|>"
        for ts in out.timestamps
    )
    assert ours == ref.text
    assert len(out.timestamps) == out.grid[0]


def test_sampling_rule_matches_hf():
    fake = SimpleNamespace(fps=2, min_frames=4, max_frames=768)
    from transformers.video_utils import VideoMetadata

    rng = np.random.default_rng(1)
    cases = [(1, 30.0), (3, 30.0), (4, 24.0), (5, 1.0), (7, 0.5), (100, 29.97), (60000, 30.0), (2000, 1.0)]
    cases += [(int(rng.integers(1, 5000)), float(rng.choice([1, 2, 5, 12, 24, 25, 29.97, 30, 60]))) for _ in range(200)]
    for total, fps in cases:
        md = VideoMetadata(total_num_frames=total, fps=fps)
        ref = hf_vp.Qwen3VLVideoProcessor.sample_frames(fake, md)
        np.testing.assert_array_equal(sample_frame_indices(total, fps), ref)
    assert len(sample_frame_indices(60000, 30.0)) == 768


def test_smart_resize_and_grid_match_hf(config):
    fake = _hf_self(config)
    rng = np.random.default_rng(2)
    dims = [(4, 32, 32), (5, 1, 1), (7, 1080, 1920), (768, 2160, 3840), (13, 17, 3000), (2, 16, 48), (9, 4000, 30)]
    dims += [(int(rng.integers(2, 800)), int(rng.integers(1, 4000)), int(rng.integers(1, 4000))) for _ in range(300)]
    for n, h, w in dims:
        if max(h, w) / min(h, w) > 200:
            continue
        ref = hf_vp.smart_resize(n, h, w, 2, 32, config.min_pixels, config.max_pixels)
        assert video_smart_resize(n, h, w, 2, 32, config.min_pixels, config.max_pixels) == ref, (n, h, w)
        t, gh, gw = video_grid(n, h, w, config)
        assert t * gh * gw == hf_vp.Qwen3VLVideoProcessor.get_num_of_video_patches(fake, n, h, w)


def test_resize_matches_torch_uint8_kernel():
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("torchvision resizes uint8 natively only on AVX2/AVX512 CPUs")
    rng = np.random.default_rng(3)
    for h, w, nh, nw in [(100, 37, 64, 32), (48, 64, 256, 320), (33, 17, 96, 64), (300, 500, 160, 256),
                         (37, 100, 32, 64), (720, 1280, 64, 96), (5, 7, 64, 64)]:
        arr = rng.integers(0, 256, (2, h, w, 3)).astype(np.uint8)
        ref = torch.nn.functional.interpolate(torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous(), size=(nh, nw),
                                              mode="bicubic", antialias=True).permute(0, 2, 3, 1).numpy()
        np.testing.assert_array_equal(resize_frames(arr, nh, nw), ref)


def test_timestamps_match_hf():
    proc = SimpleNamespace()
    for idx, fps in [([0, 3, 7, 10, 14], 29.97), ([0, 1, 2, 3], 2.0), (list(range(0, 300, 25)), 24.0), ([5], 3.0)]:
        ref = hf_proc.Qwen3VLProcessor._calculate_timestamps(proc, list(idx), fps, 2)
        assert pair_timestamps(idx, fps) == ref


def test_config_from_json(config):
    assert (config.min_pixels, config.max_pixels) == (4096, 25165824)
    assert (config.patch_size, config.temporal_patch_size, config.merge_size) == (16, 2, 2)
    assert config.fps == 2.0 and (config.min_frames, config.max_frames) == (4, 768)
    assert VideoPreprocessConfig.from_json(FIXTURE.read_text()) == config
    assert VideoPreprocessConfig.from_json({"size": {"shortest_edge": 1, "longest_edge": 2}}).max_pixels == 2


def test_row_layout_pairs_and_odd_duplicate(config):
    # 5 frames of constant per-frame value -> grid t=3, last pair = (frame 4, frame 4)
    n, h, w = 5, 64, 64
    frames = np.stack([np.full((h, w, 3), 40 * i, dtype=np.uint8) for i in range(n)])
    out = preprocess_frames(frames, list(range(n)), 1.0, config)
    t, gh, gw = out.grid
    assert t == 3
    rows = out.patches.reshape(t, gh * gw, 3, 2, 16, 16)
    for pair in range(t):
        a, b = 2 * pair, min(2 * pair + 1, n - 1)
        np.testing.assert_array_equal(rows[pair, :, :, 0], np.float32((40 * a - 127.5) / 127.5))
        np.testing.assert_array_equal(rows[pair, :, :, 1], np.float32((40 * b - 127.5) / 127.5))
    assert out.timestamps == (0.5, 2.5, 4.0)


def test_placeholder_expansion_tokens_match_hf(config, qwen_tokenizer_json):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(qwen_tokenizer_json))
    encode = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    videos = []
    hf_texts = []
    for n, h, w, fps in [(13, 64, 48, 2), (25, 120, 90, Fraction(30000, 1001))]:
        data = _make_video(n, h, w, fps, seed=n)
        ref = _hf_reference(data, config)
        out = preprocess_video(data, config)
        videos.append((out.grid, out.timestamps))
        hf_texts.append(ref.text)
    slot = "<|vision_start|><|video_pad|><|vision_end|>"
    template = f"<|im_start|>user\nA{slot}and{slot}?<|im_end|>\n"
    ids = expand_video_placeholders(encode(template), videos, encode)
    first, second = (f"<|vision_start|>{t}<|vision_end|>" for t in hf_texts)
    hf_text = f"<|im_start|>user\nA{first}and{second}?<|im_end|>\n"
    assert ids == encode(hf_text)
    # positions for the expanded prompt: one media run per temporal slice
    grids = [g for g, _ in videos]
    pos, delta = assign_positions(token_types(ids), grids)
    from tests.test_media_positions import _hf_rope_index

    ref_pos, ref_delta = _hf_rope_index(ids, video_grids=[list(g) for g in grids])
    np.testing.assert_array_equal(pos, ref_pos)
    assert delta == ref_delta
    assert sum(1 for t in ids if t == VIDEO_PAD_ID) == sum(t * h * w // 4 for t, h, w in grids)


def test_placeholder_helpers_errors():
    enc = lambda s: [ord(c) for c in s]  # noqa: E731
    ids = video_placeholder_ids((2, 4, 4), [0.25, 1.0], enc)
    assert ids == enc("<0.2 seconds>") + [VISION_START_ID] + [VIDEO_PAD_ID] * 4 + [VISION_END_ID] + enc(
        "<1.0 seconds>") + [VISION_START_ID] + [VIDEO_PAD_ID] * 4 + [VISION_END_ID]
    with pytest.raises(PositionError):
        video_placeholder_ids((2, 4, 4), [0.5], enc)
    with pytest.raises(PositionError):
        expand_video_placeholders([VISION_START_ID, VIDEO_PAD_ID, VISION_END_ID], [], enc)
    with pytest.raises(PositionError):
        expand_video_placeholders([1, VIDEO_PAD_ID, 2], [((2, 4, 4), [0.0, 1.0])], enc)


def test_budgets(config):
    data = _make_video(12, 32, 48, 4)
    for budget in (VideoBudget(max_source_frames=11), VideoBudget(max_duration_s=2.9),
                   VideoBudget(max_decoded_pixels=6 * 32 * 48 - 1), VideoBudget(max_aspect_ratio=1.4)):
        with pytest.raises(MediaBudgetExceeded) as e:
            decode_video(data, config, budget)
        assert e.value.code == "media_budget_exceeded" and isinstance(e.value, MediaError)
    assert len(decode_video(data, config, VideoBudget(max_decoded_pixels=6 * 32 * 48)).frames) == 6
    # defaults: > 600 s of video (1 fps, 601 frames, tiny frames)
    long = _make_video(601, 16, 16, 1, codec="mpeg4")
    with pytest.raises(MediaBudgetExceeded):
        decode_video(long, config)
    wide = _make_video(4, 16, 3232, 4, codec="mpeg4")  # aspect 202 > 200
    with pytest.raises(MediaBudgetExceeded):
        decode_video(wide, config)


@pytest.mark.parametrize("data", [b"", b"not a video at all", b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 40])
def test_undecodable(data, config):
    with pytest.raises(VideoDecodeError):
        decode_video(data, config)


@pytest.mark.parametrize("fmt,codec,pix_fmt", [("matroska", "ffv1", "bgr0"), ("webm", "libvpx-vp9", "yuv420p")])
def test_container_without_frame_count(config, fmt, codec, pix_fmt):
    # Matroska/WebM headers carry no frame count: the frames are counted by decoding.
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=5)
        stream.width, stream.height, stream.pix_fmt = 64, 48, pix_fmt
        for i in range(11):
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.full((48, 64, 3), 20 * i, np.uint8), "rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    dec = decode_video(buf.getvalue(), config)
    assert (dec.total_frames, dec.fps, dec.frame_indices) == (11, 5.0, (0, 3, 7, 10))
    assert dec.duration == pytest.approx(2.2)
    means = dec.frames.reshape(4, -1).mean(axis=1)
    np.testing.assert_allclose(means, [0, 60, 140, 200], atol=3)
    assert preprocess_video(dec, config).timestamps == (0.3, 1.7)


def test_single_frame_video(config):
    data = _make_video(1, 64, 64, 1)
    dec = decode_video(data, config)
    assert dec.frame_indices == (0,) and isinstance(dec, DecodedVideo)
    out = preprocess_video(dec, config)
    assert out.grid[0] == 1 and out.timestamps == (0.0,)
