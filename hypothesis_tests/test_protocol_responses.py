"""Every Responses wire object round-trips: unstructured to JSON text and structured back it is the same object, and
its JSON is stable under a second round. Requests also refuse any member they do not define."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
from hypothesis import given, settings, strategies as st

from ninfer.protocol.common import CachedTokensDetails, ReasoningTokensDetails, RequestError, structure
from ninfer.protocol.openai_responses import (CONVERTER, ChatTemplateKwargs, ContentPartAddedEvent,
                                              ContentPartDoneEvent, CreateResponseRequest, DeletedResponse,
                                              FunctionCallArgumentsDeltaEvent, FunctionCallArgumentsDoneEvent,
                                              FunctionCallItem, FunctionCallOutputItem, FunctionTool,
                                              IncompleteDetails, InputImage, InputItem, InputItemList,
                                              InputItemsQuery, InputText, InputTokens, InputTokensRequest,
                                              InputVideo, Message, OutputItem, OutputItemAddedEvent,
                                              OutputItemDoneEvent, OutputText, OutputTextDeltaEvent,
                                              OutputTextDoneEvent, ReasoningConfig, ReasoningItem, ReasoningText,
                                              ReasoningTextDeltaEvent, ReasoningTextDoneEvent, Response,
                                              ResponseCompletedEvent, ResponseCreatedEvent, ResponseError,
                                              ResponseFailedEvent, ResponseIncompleteEvent, ResponseInProgressEvent,
                                              ResponseUsage, StreamEvent, StreamOptions, TextConfig, TextFormat)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6)
texts = st.text(max_size=12)
ids = st.text(min_size=1, max_size=10)
optional = st.none().__or__
statuses = optional(st.sampled_from(["in_progress", "completed", "incomplete"]))
names = st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True)
counts = st.integers(0, 10**6)

input_texts = st.builds(InputText, text=texts)
output_texts = st.builds(OutputText, text=texts)
reasoning_texts = st.builds(ReasoningText, text=texts)
media = (st.builds(InputImage, image_url=texts, detail=optional(st.just("auto")))
         | st.builds(InputVideo, video_url=texts))
ROLE_PARTS = {"user": input_texts | media, "assistant": input_texts | output_texts, "system": input_texts,
              "developer": input_texts}


@st.composite
def messages(draw, roles=tuple(ROLE_PARTS)) -> Message:
    role = draw(st.sampled_from(roles))
    content = draw(texts | st.lists(ROLE_PARTS[role], max_size=3).map(tuple))
    return Message(role=role, content=content, id=draw(optional(ids)), status=draw(statuses))


reasoning_items = st.builds(ReasoningItem, content=optional(st.lists(reasoning_texts, max_size=2).map(tuple)),
                            id=optional(ids), status=statuses)
function_calls = st.builds(FunctionCallItem, call_id=ids, name=names, arguments=texts, id=optional(ids),
                           status=statuses)
function_outputs = st.builds(FunctionCallOutputItem, call_id=ids, output=texts, id=optional(ids), status=statuses)
input_items = messages() | reasoning_items | function_calls | function_outputs
output_items = messages(("assistant",)) | reasoning_items | function_calls

function_tools = st.builds(FunctionTool, name=names, description=optional(texts),
                           parameters=optional(st.dictionaries(st.text(max_size=4), json_values, max_size=3)),
                           strict=optional(st.just(False)))
reasoning_configs = st.builds(ReasoningConfig, effort=optional(st.sampled_from(
    ["none", "minimal", "low", "medium", "high", "xhigh", "max"])))
text_configs = st.builds(TextConfig, format=optional(st.just(TextFormat())))
metadata = st.dictionaries(st.text(max_size=64), st.text(max_size=20), max_size=16)
temperatures = st.floats(0.0, 2.0)
top_ps = st.floats(0.0, 1.0)


@st.composite
def create_requests(draw) -> CreateResponseRequest:
    preserve = draw(optional(st.booleans()))
    return CreateResponseRequest(
        model=draw(ids), input=draw(st.text(min_size=1) | st.lists(input_items, min_size=1, max_size=4).map(tuple)),
        instructions=draw(optional(texts)), previous_response_id=draw(optional(ids)),
        max_output_tokens=draw(optional(st.integers(16, 10**6))), stream=draw(optional(st.booleans())),
        store=draw(optional(st.booleans())), temperature=draw(optional(temperatures)),
        top_p=draw(optional(top_ps)), metadata=draw(optional(metadata)),
        reasoning=draw(optional(reasoning_configs)),
        chat_template_kwargs=draw(optional(st.just(ChatTemplateKwargs(preserve_thinking=preserve)))),
        preserve_thinking=preserve if draw(st.booleans()) else None, text=draw(optional(text_configs)),
        tools=draw(optional(st.lists(function_tools, max_size=2).map(tuple))),
        tool_choice=draw(optional(st.sampled_from(["auto", "none"]))),
        stream_options=draw(optional(st.just(StreamOptions(include_obfuscation=False)))),
        parallel_tool_calls=draw(optional(st.just(True))), truncation=draw(optional(st.just("disabled"))),
        top_logprobs=draw(optional(st.just(0))), service_tier=draw(optional(st.sampled_from(["auto", "default"]))),
        background=draw(optional(st.just(False))), include=draw(optional(st.just(()))))


usages = st.builds(ResponseUsage, input_tokens=counts,
                   input_tokens_details=st.builds(CachedTokensDetails, cached_tokens=counts), output_tokens=counts,
                   output_tokens_details=st.builds(ReasoningTokensDetails, reasoning_tokens=counts),
                   total_tokens=counts)
responses = st.builds(
    Response, id=ids, created_at=counts,
    status=st.sampled_from(["in_progress", "completed", "incomplete", "failed", "cancelled"]), model=ids,
    output=st.lists(output_items, max_size=3).map(tuple), usage=optional(usages),
    error=optional(st.builds(ResponseError, code=ids, message=texts)),
    incomplete_details=optional(st.just(IncompleteDetails())), instructions=optional(texts),
    previous_response_id=optional(ids), max_output_tokens=optional(st.integers(16, 10**6)),
    temperature=optional(temperatures), top_p=optional(top_ps), metadata=metadata, reasoning=reasoning_configs,
    text=text_configs, tools=st.lists(function_tools, max_size=2).map(tuple),
    tool_choice=st.sampled_from(["auto", "none"]), store=st.booleans())

located = {"item_id": ids, "output_index": counts}
indexed = {**located, "content_index": counts}
stream_events = st.one_of(
    *(st.builds(cls, sequence_number=counts, response=responses)
      for cls in (ResponseCreatedEvent, ResponseInProgressEvent, ResponseCompletedEvent, ResponseIncompleteEvent,
                  ResponseFailedEvent)),
    *(st.builds(cls, sequence_number=counts, output_index=counts, item=output_items)
      for cls in (OutputItemAddedEvent, OutputItemDoneEvent)),
    *(st.builds(cls, sequence_number=counts, part=output_texts | reasoning_texts, **indexed)
      for cls in (ContentPartAddedEvent, ContentPartDoneEvent)),
    st.builds(OutputTextDeltaEvent, sequence_number=counts, delta=texts, **indexed),
    st.builds(OutputTextDoneEvent, sequence_number=counts, text=texts, **indexed),
    st.builds(ReasoningTextDeltaEvent, sequence_number=counts, delta=texts, **indexed),
    st.builds(ReasoningTextDoneEvent, sequence_number=counts, text=texts, **indexed),
    st.builds(FunctionCallArgumentsDeltaEvent, sequence_number=counts, delta=texts, **located),
    st.builds(FunctionCallArgumentsDoneEvent, sequence_number=counts, name=names, arguments=texts, **located))

# (strategy, the type it is structured as): unions are read back through their tag.
CASES = {
    "create request": (create_requests(), CreateResponseRequest),
    "input_tokens request": (st.builds(InputTokensRequest, model=ids,
                                       input=st.text(min_size=1) | st.lists(input_items, min_size=1,
                                                                            max_size=3).map(tuple)),
                             InputTokensRequest),
    "input_items query": (st.builds(InputItemsQuery, after=optional(ids), limit=st.integers(1, 100),
                                    order=st.sampled_from(["asc", "desc"])), InputItemsQuery),
    "input item": (input_items, InputItem),
    "output item": (output_items, OutputItem),
    "response": (responses, Response),
    "stream event": (stream_events, StreamEvent),
    "input_tokens": (st.builds(InputTokens, input_tokens=counts), InputTokens),
    "deleted response": (st.builds(DeletedResponse, id=ids), DeletedResponse),
    "input item list": (st.builds(InputItemList, data=st.lists(input_items, max_size=3).map(tuple),
                                  first_id=optional(ids), last_id=optional(ids), has_more=st.booleans()),
                        InputItemList),
}


def round_trip(value: Any, cls: Any) -> tuple[Any, str]:
    """(the object read back from its JSON text, that text)."""
    text = json.dumps(CONVERTER.unstructure(value), ensure_ascii=False)
    return structure(CONVERTER, json.loads(text), cls), text


@pytest.mark.parametrize("case", list(CASES))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_every_object_round_trips_through_json(case, data):
    strategy, cls = CASES[case]
    value = data.draw(strategy)
    back, text = round_trip(value, cls)
    assert back == value
    assert round_trip(back, cls)[1] == text


@settings(max_examples=100, deadline=None)
@given(request=create_requests(),
       key=st.text(min_size=1, max_size=8).filter(lambda k: k not in attrs.fields_dict(CreateResponseRequest)))
def test_a_member_a_request_does_not_define_is_unknown_parameter(request, key):
    body = CONVERTER.unstructure(request)
    with pytest.raises(RequestError) as raised:
        structure(CONVERTER, {**body, key: 1}, CreateResponseRequest)
    assert raised.value.code == "unknown_parameter" and raised.value.param == key
