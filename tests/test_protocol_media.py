"""The media wire objects of the three protocols: every one round-trips (unstructure -> JSON -> structure gives the
same object) under hypothesis, inside the requests that carry them; unsupported variants are the typed 400s
serving.md names (modality_not_supported, image_detail_not_supported, image_file_id_not_supported, invalid_media,
unknown_parameter)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.protocol import anthropic as an
from ninfer.protocol import openai_chat as oc
from ninfer.protocol import openai_responses as orr
from ninfer.protocol.common import RequestError, structure

URLS = st.one_of(
    st.builds(lambda host, path: f"https://{host}/{path}", st.from_regex(r"[a-z]{1,12}\.(com|org)", fullmatch=True),
              st.text("abcxyz0189-_./", max_size=20)),
    st.builds(lambda kind, data: f"data:{kind};base64,{data}", st.sampled_from(["image/png", "image/jpeg",
                                                                                "video/mp4"]),
              st.from_regex(r"[A-Za-z0-9+/]{0,40}={0,2}", fullmatch=True)),
)
TEXT = st.text(max_size=30)

# --- OpenAI Chat Completions ---

CHAT_IMAGE = st.builds(oc.ImageUrlPart, type=st.just("image_url"),
                       image_url=st.one_of(URLS, st.builds(oc.MediaUrl, url=URLS,
                                                           detail=st.sampled_from([None, "auto"]))))
CHAT_VIDEO = st.builds(oc.VideoUrlPart, type=st.just("video_url"),
                       video_url=st.one_of(URLS, st.builds(oc.VideoUrl, url=URLS)))
CHAT_PARTS = st.lists(st.one_of(st.builds(oc.TextPart, type=st.just("text"), text=TEXT), CHAT_IMAGE, CHAT_VIDEO),
                      min_size=1, max_size=5).map(tuple)
CHAT_USER = st.builds(oc.UserMessage, role=st.just("user"), content=st.one_of(TEXT, CHAT_PARTS))


def round_trip(converter, obj, cls):
    data = json.loads(json.dumps(converter.unstructure(obj)))
    return converter.structure(data, cls)


@settings(max_examples=60, deadline=None)
@given(CHAT_IMAGE)
def test_chat_image_parts_round_trip(part):
    assert round_trip(oc.CONVERTER, part, oc.UserContentPart) == part


@settings(max_examples=60, deadline=None)
@given(CHAT_VIDEO)
def test_chat_video_parts_round_trip(part):
    assert round_trip(oc.CONVERTER, part, oc.UserContentPart) == part


@settings(max_examples=40, deadline=None)
@given(st.lists(CHAT_USER, min_size=1, max_size=3).map(tuple))
def test_chat_requests_with_media_round_trip(messages):
    request = oc.ChatCompletionRequest(model="m", messages=messages)
    data = json.loads(json.dumps(oc.CONVERTER.unstructure(request)))
    assert structure(oc.CONVERTER, data, oc.ChatCompletionRequest) == request


def chat_error(part: dict, role: str = "user") -> RequestError:
    with pytest.raises(RequestError) as raised:
        structure(oc.CONVERTER, {"model": "m", "messages": [{"role": role, "content": [part]}]},
                  oc.ChatCompletionRequest)
    return raised.value


@pytest.mark.parametrize("part, code, param", [
    ({"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "high"}}, "image_detail_not_supported",
     "messages[0].content[0].image_url.detail"),
    ({"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "low"}}, "image_detail_not_supported",
     "messages[0].content[0].image_url.detail"),
    ({"type": "video_url", "video_url": {"url": "https://x/y.mp4", "detail": "auto"}}, "unknown_parameter",
     "messages[0].content[0].video_url.detail"),
    ({"type": "image_url", "image_url": {}}, "missing_required_parameter", "messages[0].content[0].image_url.url"),
    ({"type": "image_url", "image_url": 5}, "invalid_type", "messages[0].content[0].image_url"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "modality_not_supported",
     "messages[0].content[0].type"),
    ({"type": "file", "file": {"file_id": "f"}}, "modality_not_supported", "messages[0].content[0].type"),
])
def test_chat_media_refusals(part, code, param):
    error = chat_error(part)
    assert (error.status, error.code, error.param) == (400, code, param)


def test_chat_media_outside_user_messages_is_refused():
    error = chat_error({"type": "image_url", "image_url": {"url": "https://x/y.png"}}, role="system")
    assert (error.code, error.param) == ("modality_not_supported", "messages[0].content[0].type")


# --- OpenAI Responses ---

RESP_IMAGE = st.builds(orr.InputImage, image_url=URLS, detail=st.sampled_from([None, "auto"]))
RESP_VIDEO = st.builds(orr.InputVideo, video_url=URLS)
RESP_USER = st.builds(orr.Message, role=st.just("user"), id=st.one_of(st.none(), st.just("msg_1")),
                      content=st.lists(st.one_of(st.builds(orr.InputText, text=TEXT), RESP_IMAGE, RESP_VIDEO),
                                       min_size=1, max_size=4).map(tuple))


@settings(max_examples=60, deadline=None)
@given(st.one_of(RESP_IMAGE, RESP_VIDEO))
def test_responses_media_parts_round_trip(part):
    assert round_trip(orr.CONVERTER, part, orr.ContentPart) == part


@settings(max_examples=40, deadline=None)
@given(st.lists(RESP_USER, min_size=1, max_size=3).map(tuple))
def test_responses_requests_with_media_round_trip(items):
    for cls in (orr.CreateResponseRequest, orr.InputTokensRequest):
        request = cls(model="m", input=items)
        data = json.loads(json.dumps(orr.CONVERTER.unstructure(request)))
        assert structure(orr.CONVERTER, data, cls) == request


@settings(max_examples=30, deadline=None)
@given(st.lists(RESP_USER, min_size=1, max_size=3).map(tuple))
def test_stored_input_item_lists_with_media_round_trip(items):
    listing = orr.InputItemList(data=items, first_id=None, last_id=None, has_more=False)
    assert round_trip(orr.CONVERTER, listing, orr.InputItemList) == listing


@pytest.mark.parametrize("part, code, param", [
    ({"type": "input_image", "image_url": "https://x", "detail": "high"}, "image_detail_not_supported",
     "input[0].content[0].detail"),
    ({"type": "input_image", "image_url": "https://x", "detail": "low"}, "image_detail_not_supported",
     "input[0].content[0].detail"),
    ({"type": "input_image", "file_id": "file_1"}, "image_file_id_not_supported", "input[0].content[0].file_id"),
    ({"type": "input_image"}, "missing_required_parameter", "input[0].content[0].image_url"),
    ({"type": "input_video"}, "missing_required_parameter", "input[0].content[0].video_url"),
    ({"type": "input_video", "video_url": "https://x", "detail": "auto"}, "unknown_parameter",
     "input[0].content[0].detail"),
    ({"type": "input_file", "file_id": "f"}, "modality_not_supported", "input[0].content[0].type"),
    ({"type": "input_audio", "input_audio": {}}, "modality_not_supported", "input[0].content[0].type"),
])
def test_responses_media_refusals(part, code, param):
    with pytest.raises(RequestError) as raised:
        structure(orr.CONVERTER, {"model": "m", "input": [{"role": "user", "content": [part]}]},
                  orr.CreateResponseRequest)
    assert (raised.value.status, raised.value.code, raised.value.param) == (400, code, param)


@pytest.mark.parametrize("role", ["assistant", "system", "developer"])
def test_responses_media_only_in_user_messages(role):
    with pytest.raises(RequestError) as raised:
        structure(orr.CONVERTER, {"model": "m", "input": [
            {"role": role, "content": [{"type": "input_image", "image_url": "https://x"}]}]}, orr.InputTokensRequest)
    assert (raised.value.code, raised.value.param) == ("invalid_value", "input[0].content[0].type")


# --- Anthropic Messages ---

MEDIA_TYPES = st.sampled_from(["image/png", "image/jpeg", "image/gif", "image/webp"])
AN_IMAGE = st.builds(an.ImageBlock, type=st.just("image"), source=st.one_of(
    st.builds(an.Base64Source, type=st.just("base64"), media_type=MEDIA_TYPES,
              data=st.from_regex(r"[A-Za-z0-9+/]{0,40}={0,2}", fullmatch=True)),
    st.builds(an.UrlSource, type=st.just("url"), url=URLS)),
    cache_control=st.one_of(st.none(), st.builds(an.CacheControl, type=st.just("ephemeral"))))
AN_USER = st.builds(an.InputMessage, role=st.just("user"), content=st.lists(
    st.one_of(st.builds(an.TextBlock, text=TEXT), AN_IMAGE,
              st.builds(an.ToolResultBlock, type=st.just("tool_result"), tool_use_id=st.just("toolu_1"),
                        content=st.lists(st.one_of(st.builds(an.TextBlock, text=TEXT), AN_IMAGE),
                                         max_size=2).map(tuple))),
    min_size=1, max_size=4).map(tuple))


@settings(max_examples=60, deadline=None)
@given(AN_IMAGE)
def test_anthropic_image_blocks_round_trip(block):
    assert round_trip(an.CONVERTER, block, an.ContentBlock) == block


@settings(max_examples=40, deadline=None)
@given(AN_USER)
def test_anthropic_requests_with_images_round_trip(message):
    for cls in (an.CountTokensRequest, an.MessagesRequest):
        request = cls(model="m", messages=(message,))
        data = json.loads(json.dumps(an.CONVERTER.unstructure(request)))
        assert structure(an.CONVERTER, data, cls) == request


@pytest.mark.parametrize("block, code, param", [
    ({"type": "image", "source": {"type": "file", "file_id": "f"}}, "invalid_media",
     "messages[0].content[0].source.type"),
    ({"type": "image", "source": {"type": "base64", "media_type": "application/pdf", "data": "AA=="}},
     "invalid_media", "messages[0].content[0].source.media_type"),
    ({"type": "image", "source": {"type": "base64", "data": "AA=="}}, "missing_required_parameter",
     "messages[0].content[0].source.media_type"),
    ({"type": "image", "source": {"type": "url"}}, "missing_required_parameter", "messages[0].content[0].source.url"),
    ({"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "AA=="}},
     "modality_not_supported", "messages[0].content[0].type"),
])
def test_anthropic_image_refusals(block, code, param):
    with pytest.raises(RequestError) as raised:
        structure(an.CONVERTER, {"model": "m", "messages": [{"role": "user", "content": [block]}]},
                  an.CountTokensRequest)
    assert (raised.value.status, raised.value.code, raised.value.param) == (400, code, param)


def test_anthropic_images_only_from_the_user():
    with pytest.raises(RequestError) as raised:
        structure(an.CONVERTER, {"model": "m", "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "image", "source": {"type": "url", "url": "https://x"}}]},
            {"role": "user", "content": "and?"}]}, an.CountTokensRequest)
    assert (raised.value.code, raised.value.param) == ("invalid_value", "messages[1].content[0].type")
