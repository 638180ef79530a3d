"""Every Anthropic Messages wire object round-trips through JSON, and a request refuses an unknown member wherever it
sits, naming its path. Objects come from the classes (see test_protocol_chat); conversations and tool choices, whose
rules span several members, have strategies of their own."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from hypothesis_tests.test_protocol_chat import (instances, protocol_classes, refuses_unknown_members,
                                                 round_trips)
from ninfer.protocol import anthropic
from ninfer.protocol.anthropic import (Base64Source, ImageBlock, InputMessage, RedactedThinkingBlock, TextBlock,
                                       ThinkingBlock, ToolChoice, ToolResultBlock, ToolUseBlock)

ROLE_BLOCKS = {"user": (TextBlock, ImageBlock, ToolResultBlock),
               "assistant": (TextBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock), "system": (TextBlock,)}


def message(role: str) -> st.SearchStrategy:
    blocks = st.one_of([instances(cls) for cls in ROLE_BLOCKS[role]])
    content = st.text(max_size=8) | st.lists(blocks, max_size=3).map(tuple)
    return st.builds(InputMessage, role=st.just(role), content=content)


@st.composite
def conversations(draw) -> tuple[InputMessage, ...]:
    """User turns with assistant answers between them, ending on a user turn; system messages only right after a
    user turn (so before an assistant one, or last)."""
    turns = []
    for i in range(draw(st.integers(1, 3))):
        if i:
            turns.append(draw(message("assistant")))
        turns.append(draw(message("user")))
        turns += draw(st.lists(message("system"), max_size=2))
    return tuple(turns)


tool_choices = (st.builds(ToolChoice, type=st.sampled_from(["auto", "any", "none"]),
                          disable_parallel_tool_use=st.none() | st.just(False))
                | st.builds(ToolChoice, type=st.just("tool"), name=st.from_regex(r"[a-z]{1,3}", fullmatch=True)))
# A base64 image names an image media type (anything else is refused as invalid_media).
base64_sources = st.builds(Base64Source, type=st.just("base64"),
                           media_type=st.sampled_from(["image/png", "image/jpeg", "image/gif", "image/webp"]),
                           data=st.text(max_size=12))
OVERRIDES = {tuple[InputMessage, ...]: conversations(), ToolChoice: tool_choices,
             InputMessage: st.sampled_from(list(ROLE_BLOCKS)).flatmap(message), Base64Source: base64_sources}


CLASSES = {cls: OVERRIDES.get(cls) or instances(cls, OVERRIDES) for cls in protocol_classes(anthropic)}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_anthropic_object_round_trips(cls, data):
    round_trips(anthropic.CONVERTER, cls, data.draw(CLASSES[cls]))


@settings(max_examples=100, deadline=None)
@given(request=CLASSES[anthropic.MessagesRequest], pick=st.integers(0, 10**6))
def test_an_unknown_member_anywhere_is_named(request, pick):
    refuses_unknown_members(anthropic.CONVERTER, anthropic.MessagesRequest, request, pick)
