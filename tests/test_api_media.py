"""Media input on all three APIs (serving.md "Multimodal request", Responses input_image/input_video, Anthropic image
blocks, the token-count endpoints): vision_disabled without a media preparer; with one (a real MediaPreparer over a
real PreparedMediaCache, no model weights needed) the placeholders are expanded with the prepared grids, usage and
token counts include the expanded media tokens, the engine gets MRoPE positions and one PromptMedia per item, every
cache reference is released when the request ends (success, error, a client that left), media errors keep their
status and code, and an expanded prompt beyond the context is context_length_exceeded.

Also: the frontend's expansion equals transformers' Qwen3-VL processor (its replace_image_token /
replace_video_token text, tokenized) and its get_rope_index positions, for a conversation with images and a video.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import threading
import time
from typing import Any

import attrs
import numpy as np
import pytest
import trio
from PIL import Image

from ninfer.engine.engine import Engine
from ninfer.frontend.media import expand_media
from ninfer.frontend.prompt import PromptOptions
from ninfer.media.acquire import AcquireLimits
from ninfer.media.cache import PreparedMediaCache
from ninfer.media.image import preprocess_image
from ninfer.media.positions import IMAGE_PAD_ID, VIDEO_PAD_ID, PositionError, assign_positions, token_types
from ninfer.media.prepare import MediaBudgets, MediaItem, MediaPreparer
from ninfer.server.anthropic import count_tokens, create_message
from ninfer.server.context import ApiError, HttpRequest
from ninfer.server.errors import error_body
from ninfer.server.generation import build_media_prompt, prepare_prompt
from ninfer.server.openai_chat import create_chat_completion
from ninfer.server.openai_responses import ResponsesApi
from ninfer.server.routing import Router
from ninfer.targets.registry import QWEN_27B_PRESETS
from tests.test_generation_adapter import (MAX_CONTEXT, EngineContext, FakeOptions, ScriptedRunner, engine_config,
                                           left_early, post, qwen_builder, script_of)

MODEL = "qwen3.6-27b"
MIB = 1 << 20
HIDDEN = 8  # the fake Vision tower's output width


def png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


IMAGE = png(64, 48, seed=1)  # upscaled to the processor's minimum area
IMAGE_TOKENS = preprocess_image(IMAGE).num_tokens
OTHER = png(300, 200, seed=2)
OTHER_TOKENS = preprocess_image(OTHER).num_tokens


@pytest.fixture(scope="module")
def builder(qwen_tokenizer_json):
    return qwen_builder(qwen_tokenizer_json)


class VisionRunner(ScriptedRunner):
    """The scripted runner with a stand-in Vision tower: every item encodes to zero rows."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(script)
        self.info = attrs.evolve(self.info, vision=True)
        self.encoded: list[Any] = []

    def encode_media(self, item):
        self.encoded.append(item)
        return np.zeros((len(item.columns), HIDDEN), np.float32)


@attrs.frozen
class MediaOptions(FakeOptions):
    vision: bool = True
    response_store_max_records: int = 64
    response_store_max_mib: int = 64


@attrs.define
class MediaContext(EngineContext):
    """EngineContext with a media preparer (what a --vision server's model stack has)."""

    media_preparer: Any = None
    runner: Any = None


def preparer(*, budgets: MediaBudgets | None = None, limits: AcquireLimits | None = None,
             live_mib: int = 256) -> MediaPreparer:
    cache = PreparedMediaCache(cache_bytes=64 * MIB, live_bytes=live_mib * MIB)
    return MediaPreparer(cache, threads=2, budgets=budgets, acquire_limits=limits)


@pytest.fixture
def vision(builder):
    """A vision context whose model answers "Hm.</think>\\n\\nA cat."; its preparer is closed afterwards."""
    runner = VisionRunner(script_of(builder.tokenizer, "Hm.</think>\n\nA cat."))
    engine = Engine(runner, engine_config(), QWEN_27B_PRESETS).start()
    ctx = MediaContext(engine, builder, options=MediaOptions(), media_preparer=preparer(), runner=runner)
    with engine:
        yield ctx
    ctx.media_preparer.close()


def open_handles(ctx) -> int:
    return ctx.media_preparer._cache.stats().open_handles


def text_tokens(builder, messages, options=PromptOptions()) -> list[int]:
    """The template's own tokens for `messages` (one pad per media part)."""
    return list(builder.build(messages, options).ids)


def image_part(data: bytes = IMAGE) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def chat_body(content, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 20, **extra}


def refusal(ctx, handler, body) -> ApiError:
    with pytest.raises(ApiError) as raised:
        post(ctx, handler, body)
    return raised.value


# ---- Chat Completions ----

def test_a_chat_image_is_expanded_counted_and_given_to_the_engine(vision, builder):
    content = [{"type": "text", "text": "What is this?"}, image_part()]
    response = post(vision, create_chat_completion, chat_body(content))
    assert response.status == 200
    template = text_tokens(builder, [{"role": "user", "content": content}])
    assert template.count(IMAGE_PAD_ID) == 1
    usage = response.body["usage"]
    assert usage["prompt_tokens"] == len(template) - 1 + IMAGE_TOKENS
    assert response.body["choices"][0]["message"]["content"] == "A cat."

    prompt, _ = vision.submitted[0]
    ids = prompt.token_ids.tolist()
    assert len(ids) == usage["prompt_tokens"] and ids.count(IMAGE_PAD_ID) == IMAGE_TOKENS
    (item,) = prompt.media
    assert (item.modality, item.digest) == ("image", hashlib.sha256(IMAGE).hexdigest())
    assert item.grid == preprocess_image(IMAGE).grid and item.patches.dtype == np.uint16
    assert item.columns.tolist() == [i for i, t in enumerate(ids) if t == IMAGE_PAD_ID]
    positions, delta = assign_positions(token_types(ids), [item.grid])
    np.testing.assert_array_equal(prompt.positions, positions)
    assert prompt.rope_delta == delta < 0  # an image's positions advance by max(h, w), not by its token count
    # the generation prompt's boundaries sit after the expansion
    assert prompt.prologue_end == len(ids)
    assert [x.digest for x in vision.runner.encoded] == [item.digest]
    assert open_handles(vision) == 0  # released once the request ended


def test_images_and_text_in_order_stream_and_count_the_same(vision, builder):
    content = [image_part(OTHER), {"type": "text", "text": "and"}, image_part(IMAGE), image_part(OTHER)]
    events = post(vision, create_chat_completion, chat_body(content, stream=True,
                                                            stream_options={"include_usage": True}))
    usage = json.loads(events[-2].data)["usage"]
    template = text_tokens(builder, [{"role": "user", "content": content}])
    assert usage["prompt_tokens"] == len(template) - 3 + 2 * OTHER_TOKENS + IMAGE_TOKENS
    prompt, _ = vision.submitted[0]
    assert [m.grid for m in prompt.media] == [preprocess_image(x).grid for x in (OTHER, IMAGE, OTHER)]
    assert prompt.media[0].digest == prompt.media[2].digest != prompt.media[1].digest
    assert prompt.media[0].columns[-1] < prompt.media[1].columns[0] < prompt.media[2].columns[0]
    assert open_handles(vision) == 0
    stats = vision.media_preparer._cache.stats()
    assert stats.misses == 2  # the repeated image was built once


def test_a_client_that_leaves_releases_the_media(builder):
    runner = VisionRunner(script_of(builder.tokenizer, "word " * 200, stop=False))
    engine = Engine(runner, engine_config(), QWEN_27B_PRESETS).start()
    ctx = MediaContext(engine, builder, options=MediaOptions(), media_preparer=preparer())
    try:
        with engine:
            running = left_early(ctx, create_chat_completion, chat_body([image_part()], stream=True,
                                                                        max_tokens=150), 2)
        assert running == 0 and open_handles(ctx) == 0
    finally:
        ctx.media_preparer.close()


def test_an_expanded_prompt_beyond_the_context_is_context_length_exceeded(vision):
    big = png(1024, 1024, seed=5)  # (1024/32)^2 = 1024 tokens each: two exceed the 2048-token context
    error = refusal(vision, create_chat_completion, chat_body([image_part(big), image_part(big)]))
    assert (error.status, error.code) == (400, "context_length_exceeded")
    assert error.extra["prompt_tokens"] > error.extra["max_context"] == MAX_CONTEXT
    assert open_handles(vision) == 0 and vision.submitted == []


def test_a_budget_rejection_is_media_budget_exceeded_and_leaves_nothing(builder):
    ctx = MediaContext(Engine(VisionRunner([]), engine_config(), QWEN_27B_PRESETS).start(), builder,
                       options=MediaOptions(), media_preparer=preparer(budgets=MediaBudgets(max_vision_tokens=10)))
    try:
        with ctx.engine:
            error = refusal(ctx, create_chat_completion, chat_body([image_part()]))
        assert (error.status, error.code) == (400, "media_budget_exceeded")
        body = error_body(error, "openai")["error"]
        assert (body["type"], body["code"], body["param"]) == ("invalid_request_error", "media_budget_exceeded",
                                                                None)
        assert "vision tokens" in body["message"]
        assert error_body(error, "anthropic")["error"]["type"] == "invalid_request_error"
        assert open_handles(ctx) == 0 and ctx.media_preparer._cache.stats().reserved_bytes == 0
    finally:
        ctx.media_preparer.close()


@pytest.mark.parametrize("url, status, code", [
    ("data:image/png;base64,AAAA", 400, "invalid_media"),  # not an image
    ("file:///etc/passwd", 400, "invalid_media_url"),
    ("http://127.0.0.1:9/x.png", 400, "media_url_forbidden"),
])
def test_media_errors_keep_their_status_and_code(vision, url, status, code):
    error = refusal(vision, create_chat_completion,
                    chat_body([{"type": "image_url", "image_url": {"url": url}}]))
    assert (error.status, error.code) == (status, code)
    assert open_handles(vision) == 0 and vision.submitted == []


def test_an_unreachable_host_is_media_fetch_failed_502(builder):
    limits = AcquireLimits(allow_private_networks=True, connect_timeout_s=2, total_timeout_s=5)
    ctx = MediaContext(Engine(VisionRunner([]), engine_config(), QWEN_27B_PRESETS).start(), builder,
                       options=MediaOptions(), media_preparer=preparer(limits=limits))
    try:
        with ctx.engine:
            error = refusal(ctx, create_chat_completion,
                            chat_body([{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]))
        assert (error.status, error.code, error.type) == (502, "media_fetch_failed", "server_error")
    finally:
        ctx.media_preparer.close()


def test_media_placeholder_text_cannot_stand_in_for_media(vision):
    content = [{"type": "text", "text": "<|vision_start|><|image_pad|><|vision_end|>"}, image_part()]
    error = refusal(vision, create_chat_completion, chat_body(content))
    assert (error.status, error.code) == (400, "invalid_media")
    assert open_handles(vision) == 0


def test_without_a_preparer_media_is_vision_disabled_with_its_body(builder):
    ctx = MediaContext(Engine(VisionRunner([]), engine_config(), QWEN_27B_PRESETS).start(), builder,
                       options=MediaOptions(vision=False))
    with ctx.engine:
        error = refusal(ctx, create_chat_completion, chat_body([{"type": "text", "text": "a"},
                                                                   {"type": "video_url", "video_url": {"url": "data:,x"}}]))
    assert error_body(error, "openai") == {"error": {
        "message": "image and video input needs a server started with --vision", "type": "invalid_request_error",
        "param": "messages[0].content[1]", "code": "vision_disabled"}}
    assert error.status == 400


# ---- Anthropic Messages ----

def anthropic_image(data: bytes = IMAGE) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(data).decode()}}


def test_anthropic_images_count_and_generate(vision, builder):
    messages = [{"role": "user", "content": [anthropic_image(), {"type": "text", "text": "What is it?"}]}]
    counted = post(vision, count_tokens, {"model": "m", "messages": messages}).body["input_tokens"]
    chat_form = [{"role": "user", "content": [image_part(), {"type": "text", "text": "What is it?"}]}]
    assert counted == len(text_tokens(builder, chat_form)) - 1 + IMAGE_TOKENS
    assert open_handles(vision) == 0
    response = post(vision, create_message, {"model": "m", "max_tokens": 20, "messages": messages})
    assert response.body["usage"]["input_tokens"] == counted
    assert vision.submitted[0][0].media[0].digest == hashlib.sha256(IMAGE).hexdigest()
    assert open_handles(vision) == 0


def test_anthropic_tool_result_images_are_media_too(vision, builder):
    messages = [{"role": "user", "content": "Show me."},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": [anthropic_image(OTHER)]}]}]
    counted = post(vision, count_tokens, {"model": "m", "messages": messages}).body["input_tokens"]
    chat_form = [{"role": "user", "content": "Show me."},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "t1", "type": "function", "function": {"name": "shot", "arguments": {}}}]},
                 {"role": "tool", "tool_call_id": "t1", "content": [image_part(OTHER)]}]
    assert counted == len(text_tokens(builder, chat_form)) - 1 + OTHER_TOKENS


def test_anthropic_and_responses_refuse_an_expanded_prompt_beyond_the_context(vision):
    big = png(1024, 1024, seed=5)  # two of these exceed the 2048-token context once expanded
    messages = [{"role": "user", "content": [anthropic_image(big), anthropic_image(big)]}]
    error = refusal(vision, create_message, {"model": "m", "max_tokens": 20, "messages": messages})
    assert (error.status, error.code) == (400, "context_length_exceeded")
    assert error.extra["prompt_tokens"] > error.extra["max_context"] == MAX_CONTEXT
    item = {"role": "user", "content": [{"type": "input_image", "image_url": data_url(big)},
                                        {"type": "input_image", "image_url": data_url(big)}]}
    with pytest.raises(ApiError) as raised:
        Responses(vision).post("/v1/responses", {"model": MODEL, "input": [item]})
    assert (raised.value.status, raised.value.code) == (400, "context_length_exceeded")
    assert open_handles(vision) == 0 and vision.submitted == []


def test_anthropic_url_source_and_non_image_media_type(vision):
    url = {"type": "image", "source": {"type": "url", "url": "ftp://example.com/x.png"}}
    error = refusal(vision, count_tokens, {"model": "m", "messages": [{"role": "user", "content": [url]}]})
    assert (error.status, error.code) == (400, "invalid_media_url")
    pdf = {"type": "image", "source": {"type": "base64", "media_type": "application/pdf", "data": "AA=="}}
    error = refusal(vision, count_tokens, {"model": "m", "messages": [{"role": "user", "content": [pdf]}]})
    assert (error.status, error.code, error.param) == (400, "invalid_media", "messages[0].content[0].source.media_type")


def test_anthropic_count_tokens_without_vision_is_vision_disabled(builder):
    ctx = MediaContext(Engine(VisionRunner([]), engine_config(), QWEN_27B_PRESETS).start(), builder)
    with ctx.engine:
        error = refusal(ctx, count_tokens, {"model": "m", "messages": [{"role": "user",
                                                                         "content": [anthropic_image()]}]})
    assert (error.status, error.code, error.param) == (400, "vision_disabled", "messages[0].content[0]")
    assert error_body(error, "anthropic") == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "image and video input needs a server started with --vision"}}


# ---- Responses ----

@attrs.define
class Responses:
    ctx: MediaContext
    api: ResponsesApi = attrs.Factory(ResponsesApi)

    def post(self, path: str, body: dict) -> Any:
        route, params = Router(self.api.routes()).match("POST", path)

        async def main():
            request = HttpRequest(method="POST", path=path, path_params=params, query={}, headers={},
                                  body=json.dumps(body).encode())
            return await route.handler(self.ctx, request)

        return trio.run(main)


def responses_image(url: str) -> dict:
    return {"role": "user", "content": [{"type": "input_text", "text": "Describe."},
                                        {"type": "input_image", "image_url": url}]}


def test_responses_input_tokens_and_usage_include_the_media(vision, builder):
    api = Responses(vision)
    item = responses_image(data_url(IMAGE))
    counted = api.post("/v1/responses/input_tokens", {"model": MODEL, "input": [item]}).body
    chat_form = [{"role": "user", "content": [{"type": "text", "text": "Describe."}, image_part()]}]
    expected = len(text_tokens(builder, chat_form)) - 1 + IMAGE_TOKENS
    assert counted == {"object": "response.input_tokens", "input_tokens": expected}
    response = api.post("/v1/responses", {"model": MODEL, "input": [item]}).body
    assert response["usage"]["input_tokens"] == expected
    assert open_handles(vision) == 0


def test_responses_input_tokens_without_vision_is_vision_disabled(builder):
    ctx = MediaContext(Engine(VisionRunner([]), engine_config(), QWEN_27B_PRESETS).start(), builder,
                       options=MediaOptions(vision=False))
    with ctx.engine:
        with pytest.raises(ApiError) as raised:
            Responses(ctx).post("/v1/responses/input_tokens",
                                {"model": MODEL, "input": [{"role": "user", "content": [
                                    {"type": "input_video", "video_url": "data:video/mp4;base64,AA=="}]}]})
    assert (raised.value.status, raised.value.code, raised.value.param) == (400, "vision_disabled",
                                                                            "input[0].content[0]")


class _ImageServer:
    """A local HTTP server that serves one PNG and counts its fetches."""

    def __init__(self, data: bytes, delay: float = 0.0) -> None:
        hits = self.hits = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                hits.append(self.path)
                time.sleep(delay)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/cat.png"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_continued_chain_fetches_its_http_media_again(builder):
    served = _ImageServer(IMAGE)
    runner = VisionRunner(script_of(builder.tokenizer, "Hm.</think>\n\nA cat."))
    ctx = MediaContext(Engine(runner, engine_config(), QWEN_27B_PRESETS).start(), builder, options=MediaOptions(),
                       media_preparer=preparer(limits=AcquireLimits(allow_private_networks=True)))
    try:
        with ctx.engine:
            api = Responses(ctx)
            first = api.post("/v1/responses", {"model": MODEL, "input": [responses_image(served.url)]}).body
            assert len(served.hits) == 1
            second = api.post("/v1/responses", {"model": MODEL, "input": "And its colour?",
                                                "previous_response_id": first["id"]}).body
            assert len(served.hits) == 2  # the stored Item kept the URL, not the payload
            listed = ctx.submitted[1][0]
            assert [m.digest for m in listed.media] == [hashlib.sha256(IMAGE).hexdigest()]
            assert second["usage"]["input_tokens"] == len(listed)
            stored = api.api.store(ctx).get(first["id"]).input_items[0].content[1]
            assert stored.image_url == served.url
        assert open_handles(ctx) == 0
    finally:
        served.close()
        ctx.media_preparer.close()


# ---- video, and parity with transformers' processor ----

def test_a_chat_video_is_expanded_with_its_timestamps(vision, builder):
    from tests.test_media_video import _make_video

    video = _make_video(12, 64, 96, 4)
    content = [{"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}},
               {"type": "text", "text": "What happens?"}]
    response = post(vision, create_chat_completion, chat_body(content))
    prompt, _ = vision.submitted[0]
    (item,) = prompt.media
    payload = vision.media_preparer.prepare([MediaItem("video", data_url(video, "video/mp4"))])
    try:
        (want,) = payload.payloads
        assert item.grid == want.grid and item.modality == "video"
        ids = prompt.token_ids.tolist()
        assert ids.count(VIDEO_PAD_ID) == want.num_tokens == len(item.columns)
        # each stamp sits between special tokens, so it is tokenized on its own
        stamp_tokens = sum(len(builder.tokenizer.encode(f"<{ts:.1f} seconds>")) for ts in want.timestamps)
        template = text_tokens(builder, [{"role": "user", "content": content}])
        # per temporal pair: timestamp text, <|vision_start|>, pads, <|vision_end|>; the template's one pad goes
        assert response.body["usage"]["prompt_tokens"] == (len(template) - 1 + want.num_tokens + stamp_tokens
                                                           + 2 * want.grid[0])
    finally:
        payload.release()


def test_expansion_and_positions_equal_transformers_processor(builder):
    torch = pytest.importorskip("torch")
    pytest.importorskip("av")
    from types import SimpleNamespace

    from transformers.models.qwen3_vl import processing_qwen3_vl as hf_proc

    from tests.test_media_positions import _hf_rope_index
    from tests.test_media_video import _hf_reference, _make_video
    from ninfer.media.video import VideoPreprocessConfig

    video = _make_video(13, 64, 48, 2, seed=3)
    ref = _hf_reference(video, VideoPreprocessConfig())
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [image_part(OTHER), {"type": "text", "text": "then"},
                                             {"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}},
                                             image_part(IMAGE), {"type": "text", "text": "Compare."}]}]
    prompt = builder.build(messages)
    prep = preparer()
    try:
        with prep.prepare([MediaItem(s.modality, s.url) for s in prompt.media]) as prepared:
            prepared_prompt = prepare_prompt(builder, prompt, PromptOptions(), prepared)
            grids = [p.grid for p in prepared.payloads]
            assert grids[1] == ref.grid
    finally:
        prep.close()

    # transformers' processor: each pad of the rendered text replaced by its replace_*_token text, in order
    fake = SimpleNamespace(image_processor=SimpleNamespace(merge_size=2), image_token="<|image_pad|>")
    images = {"image_grid_thw": torch.tensor([grids[0], grids[2]])}
    text, image_index = prompt.text, 0
    parts = []
    for piece in text.split("<|vision_start|>"):
        if piece.startswith("<|image_pad|>"):
            piece = hf_proc.Qwen3VLProcessor.replace_image_token(fake, images, image_index) + piece[13:]
            image_index += 1
        elif piece.startswith("<|video_pad|>"):
            piece = ref.text + piece[13:]
        parts.append(piece)
    hf_ids = builder.tokenizer.encode("<|vision_start|>".join(parts))
    assert prepared_prompt.token_ids.tolist() == hf_ids
    hf_positions, hf_delta = _hf_rope_index(hf_ids, image_grids=[list(grids[0]), list(grids[2])],
                                            video_grids=[list(grids[1])])
    np.testing.assert_array_equal(prepared_prompt.positions, hf_positions)
    assert prepared_prompt.rope_delta == hf_delta


def test_expand_media_checks_parts_against_placeholders():
    item = SimpleItem((1, 4, 4), 4)
    ids = [1, 248053, IMAGE_PAD_ID, 248054, 2]
    expanded = expand_media(ids, ["image"], [item], lambda s: [])
    assert expanded.ids == (1, 248053, *[IMAGE_PAD_ID] * 4, 248054, 2)
    assert expanded.columns[0].tolist() == [2, 3, 4, 5]
    with pytest.raises(PositionError):
        expand_media(ids, ["video"], [item], lambda s: [])
    with pytest.raises(PositionError):
        expand_media(ids + ids, ["image"], [item], lambda s: [])
    with pytest.raises(PositionError):
        expand_media(ids, ["image", "image"], [item, item], lambda s: [])


@attrs.frozen
class SimpleItem:
    grid: tuple[int, int, int]
    num_tokens: int
    timestamps: tuple[float, ...] = ()


def test_build_media_prompt_releases_on_a_placeholder_mismatch(builder):
    ctx = MediaContext(None, builder, options=MediaOptions(), media_preparer=preparer())
    messages = [{"role": "user", "content": [{"type": "text", "text": "<|video_pad|>"}, image_part()]}]
    try:
        with pytest.raises(ApiError) as raised:
            trio.run(lambda: build_media_prompt(ctx, messages, PromptOptions()))
        assert raised.value.code == "invalid_media" and open_handles(ctx) == 0
    finally:
        ctx.media_preparer.close()


# ---- the server's context: pending deadline, request log, release at the end of the request's scope ----

def serving_context(builder, log_path, *, pending_timeout_ms: int = 60_000, budgets: MediaBudgets | None = None):
    from types import SimpleNamespace

    from ninfer.nursery.admission import AdmissionGate
    from ninfer.observability.request_log import RequestLog
    from ninfer.server.serving_context import ServingContext
    from tests.test_generation_adapter import STOP_IDS

    runner = VisionRunner(script_of(builder.tokenizer, "Hm.</think>\n\nA cat."))
    engine = Engine(runner, engine_config(), QWEN_27B_PRESETS).start()
    stack = SimpleNamespace(public_model_id=MODEL, prompt_builder=builder, stop_ids=STOP_IDS, engine=engine,
                            media_preparer=preparer(budgets=budgets))
    options = SimpleNamespace(max_context=MAX_CONTEXT, pending_timeout_ms=pending_timeout_ms, spec=None,
                              no_thinking=False, preserve_thinking=False, vision=True)
    return ServingContext(options, stack, AdmissionGate(4), RequestLog(open(log_path, "w")), started_unix=0)


def in_scope(ctx, body: dict, *, read_stream: bool = True) -> Any:
    """One chat request inside a request scope, as the app runs it (a rejection is noted as the app notes it)."""
    from ninfer.server.context import StreamResponse

    async def main():
        request = HttpRequest(method="POST", path="/", path_params={}, query={}, headers={},
                              body=json.dumps(body).encode())
        with ctx.request_scope() as scope:
            try:
                response = await create_chat_completion(ctx, request)
            except ApiError as error:
                ctx.note_rejection(scope, error)
                return error
            if isinstance(response, StreamResponse):
                if not read_stream:
                    return response
                return [event async for event in response.events]
            return response

    return trio.run(main)


def log_records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_request_log_records_the_media_preparation(builder, tmp_path):
    ctx = serving_context(builder, tmp_path / "log.jsonl")
    try:
        with ctx.engine:
            response = in_scope(ctx, chat_body([image_part(), image_part(), {"type": "text", "text": "Same?"}]))
        assert response.status == 200
        start = next(r for r in log_records(tmp_path / "log.jsonl") if r["event"] == "request_start")
        assert start["shape"]["media_items"] == 2
        media = start["media"]
        assert (media["items"], media["images"], media["videos"]) == (2, 2, 0)
        assert media["acquired_bytes"] == 2 * len(IMAGE) and media["vision_tokens"] == 2 * IMAGE_TOKENS
        assert media["cache_misses"] + media["single_flight_joins"] + media["cache_hits"] == 2
        assert media["payload_bytes"] > 0 and media["wall_seconds"] >= media["work_seconds"] >= 0
        assert start["prompt_tokens"] == response.body["usage"]["prompt_tokens"]
        assert ctx.media_preparer._cache.stats().open_handles == 0
    finally:
        ctx.media_preparer.close()


def test_a_rejected_media_request_is_logged_with_its_media_count(builder, tmp_path):
    ctx = serving_context(builder, tmp_path / "log.jsonl", budgets=MediaBudgets(max_vision_tokens=1))
    try:
        with ctx.engine:
            error = in_scope(ctx, chat_body([image_part()]))
        assert (error.status, error.code) == (400, "media_budget_exceeded")
        (rejected,) = [r for r in log_records(tmp_path / "log.jsonl") if r["event"] == "request_rejected"]
        assert (rejected["media_items"], rejected["phase"], rejected["code"]) == (1, "prepare",
                                                                                  "media_budget_exceeded")
    finally:
        ctx.media_preparer.close()


def test_a_passed_pending_deadline_is_request_queue_timeout(builder, tmp_path):
    ctx = serving_context(builder, tmp_path / "log.jsonl", pending_timeout_ms=0)
    try:
        with ctx.engine:
            error = in_scope(ctx, chat_body([image_part()]))
        assert (error.status, error.code) == (503, "request_queue_timeout")
        assert ctx.media_preparer._cache.stats().open_handles == 0
    finally:
        ctx.media_preparer.close()


def test_the_request_scope_releases_media_a_response_never_read(builder, tmp_path):
    ctx = serving_context(builder, tmp_path / "log.jsonl")
    try:
        with ctx.engine:
            response = in_scope(ctx, chat_body([image_part()], stream=True), read_stream=False)
            assert ctx.media_preparer._cache.stats().open_handles == 0  # the scope ended: its media went
            trio.run(response.events.aclose)
    finally:
        ctx.media_preparer.close()


# ---- end to end: the real server with --vision over a tiny converted Qwen3.6 checkpoint with a Vision tower ----

@pytest.fixture(scope="module")
def vision_artifact(dense_checkpoint, tmp_path_factory):
    from ninfer.convert.driver import convert
    from ninfer.convert.qwen_hf import plan_qwen_checkpoint

    out = tmp_path_factory.mktemp("api-media") / "tiny.ninfer"
    convert(plan_qwen_checkpoint(dense_checkpoint), out, "bf16", progress=False)
    yield out
    out.unlink()  # 115 MB: CI machines can be short of disk


def test_the_server_serves_media_on_every_api(vision_artifact, tmp_path):
    import httpx

    from tests.support.server_harness import server_starter

    log_path = tmp_path / "requests.jsonl"
    with server_starter(vision_artifact, "--max-context", "2048", "--prefill-chunk", "512") as start:
        server = start("--vision", "--seed", "3", request_log=log_path)
        stack = server.runtime.stack
        model = stack.public_model_id
        with stack.media_preparer.prepare([MediaItem("image", data_url(IMAGE))]) as prepared:
            tokens = prepared.payloads[0].num_tokens
        assert tokens < 2048 < 2 * tokens  # two of the images are over the Vision budget, one is not
        chat_form = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image_part()]}]
        expected = len(stack.prompt_builder.build(chat_form).ids) - 1 + tokens

        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": model, "max_tokens": 3, "messages": chat_form})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == expected

        anthropic_form = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, anthropic_image()]}]
        counted = httpx.post(f"{server.url}/v1/messages/count_tokens", timeout=60,
                             json={"model": model, "messages": anthropic_form})
        assert counted.json() == {"input_tokens": expected}
        message = httpx.post(f"{server.url}/v1/messages", timeout=120,
                             json={"model": model, "max_tokens": 3, "messages": anthropic_form}).json()
        usage = message["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == expected

        responses_form = [{"role": "user", "content": [{"type": "input_text", "text": "What is it?"},
                                                       {"type": "input_image", "image_url": data_url(IMAGE)}]}]
        counted = httpx.post(f"{server.url}/v1/responses/input_tokens", timeout=60,
                             json={"model": model, "input": responses_form}).json()
        assert counted["input_tokens"] == expected
        response = httpx.post(f"{server.url}/v1/responses", timeout=120,
                              json={"model": model, "max_output_tokens": 16, "input": responses_form}).json()
        assert response["usage"]["input_tokens"] == expected

        budget = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": model, "max_tokens": 3,
            "messages": [{"role": "user", "content": [image_part(), image_part()]}]})
        assert budget.status_code == 400 and budget.json()["error"]["code"] == "media_budget_exceeded"
        assert stack.media_preparer._cache.stats().open_handles == 0

        text_only = start()  # without --vision
        refused = httpx.post(f"{text_only.url}/v1/messages/count_tokens", timeout=60,
                             json={"model": model, "messages": anthropic_form})
        assert refused.status_code == 400
        assert refused.json()["error"]["type"] == "invalid_request_error"
        refused = httpx.post(f"{text_only.url}/v1/responses/input_tokens", timeout=60,
                             json={"model": model, "input": responses_form})
        assert (refused.status_code, refused.json()["error"]["code"]) == (400, "vision_disabled")

    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    starts = [r for r in records if r["event"] == "request_start"]
    assert len(starts) == 3 and all(r["media"]["items"] == 1 and r["prompt_tokens"] == expected for r in starts)
    (rejected,) = [r for r in records if r["event"] == "request_rejected"]
    assert (rejected["code"], rejected["media_items"]) == ("media_budget_exceeded", 2)


def test_a_request_cancelled_during_preparation_leaves_no_reference(builder):
    served = _ImageServer(IMAGE, delay=0.5)
    ctx = MediaContext(None, builder, options=MediaOptions(),
                       media_preparer=preparer(limits=AcquireLimits(allow_private_networks=True)))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": served.url}}]}]

    async def main():
        with trio.move_on_after(0.1) as scope:  # the client leaves while the image is being fetched
            await build_media_prompt(ctx, messages, PromptOptions())
        return scope.cancelled_caught

    try:
        assert trio.run(main)
        cache = ctx.media_preparer._cache
        deadline = time.monotonic() + 10
        # the abandoned worker finishes the preparation (the payload is built and retained)...
        while cache.stats().cached_entries == 0 or cache.stats().in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        while open_handles(ctx):  # ...and releases what it prepared itself
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.2)
        assert open_handles(ctx) == 0 and cache.stats().referenced_bytes == 0
        assert served.hits == ["/cat.png"]
    finally:
        served.close()
        ctx.media_preparer.close()
