"""Responses Items in and out of the chat-form conversation the prompt is built from (serving.md "Input Item
contract").

Input: a string is one user message with an input_text part; string message content becomes one text part; Items
without an id get one, supplied ids are kept, and a duplicate among them fails; function_call arguments must be the
JSON text of an object. These normalized Items are what GET /v1/responses/{id}/input_items lists and what a
continuation replays.

Lowering: each message Item is one chat message at its position (system and developer ones included: the frontend
places them). A function_call Item joins the assistant turn right before it (an assistant message, or earlier calls),
so a replayed answer with its calls renders as the one turn the model wrote; otherwise it opens a turn of its own. A
reasoning Item becomes the `reasoning_content` of the assistant turn that the next assistant message or function call
opens; one that nothing follows (output cut during reasoning) stays as an assistant turn of its own with no text.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any

import attrs

from ninfer.protocol.common import RequestError
from ninfer.protocol.openai_responses import (MEDIA_PARTS, ContentPart, FunctionCallItem, FunctionCallOutputItem,
                                              FunctionTool, InputImage, InputItem, InputText, Message, OutputText,
                                              ReasoningItem)

ID_PREFIXES = {Message: "msg", ReasoningItem: "rs", FunctionCallItem: "fc", FunctionCallOutputItem: "fco"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def normalize_input(items: str | tuple[InputItem, ...]) -> tuple[InputItem, ...]:
    """The request's `input` as the Items it stores (see the module docstring); RequestError on a bad Item."""
    if isinstance(items, str):
        items = (Message(role="user", content=items),)
    seen: set[str] = set()
    for index, item in enumerate(items):
        if item.id is not None:
            if item.id in seen:
                raise RequestError(f"the id {item.id!r} is used by more than one input Item",
                                   code="duplicate_item_id", param=f"input[{index}].id")
            seen.add(item.id)
        if isinstance(item, FunctionCallItem):
            _check_arguments(item.arguments, f"input[{index}].arguments")
    return tuple(_normalized(item) for item in items)


def _check_arguments(arguments: str, param: str) -> None:
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise RequestError(f"{param}: not valid JSON ({exc})", param=param) from None
    if not isinstance(parsed, dict):
        raise RequestError(f"{param}: must be the JSON text of an object", param=param)


def _normalized(item: InputItem) -> InputItem:
    changes: dict[str, Any] = {}
    if item.id is None:
        changes["id"] = new_id(ID_PREFIXES[type(item)])
    if isinstance(item, Message) and isinstance(item.content, str):
        part = OutputText(text=item.content) if item.role == "assistant" else InputText(text=item.content)
        changes["content"] = (part,)
    return attrs.evolve(item, **changes) if changes else item


def media_params(items: Sequence[InputItem]) -> list[str]:
    """The `input[i].content[j]` of each image or video part, for the vision check."""
    return [f"input[{i}].content[{j}]" for i, item in enumerate(items)
            if isinstance(item, Message) and not isinstance(item.content, str)
            for j, part in enumerate(item.content) if isinstance(part, MEDIA_PARTS)]


def chat_tools(tools: Sequence[FunctionTool]) -> list[dict[str, Any]]:
    """Flat Responses function definitions in the nested form the templates and the tool-call parser read."""
    return [{"type": "function", "function": {key: value for key, value in attrs.asdict(tool).items()
                                              if key != "type" and value is not None}} for tool in tools]


def chat_messages(items: Sequence[InputItem], instructions: str | None = None) -> list[dict[str, Any]]:
    """The conversation as chat-form messages for the PromptBuilder; `instructions` leads as a developer turn."""
    messages: list[dict[str, Any]] = [{"role": "developer", "content": instructions}] if instructions else []
    reasoning: list[str] = []  # reasoning Items waiting for the assistant turn they belong to
    open_turn: dict[str, Any] | None = None  # the assistant turn a following function call joins

    def assistant_turn(content: str | list[dict[str, Any]]) -> dict[str, Any]:
        turn: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            turn["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        messages.append(turn)
        return turn

    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning.append(item.text)
            open_turn = None
        elif isinstance(item, FunctionCallItem):
            if open_turn is None:
                open_turn = assistant_turn("")
            open_turn.setdefault("tool_calls", []).append(
                {"type": "function", "id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, Message) and item.role == "assistant":
            open_turn = assistant_turn(_chat_content(item.content))
        else:
            if reasoning:
                assistant_turn("")
            open_turn = None
            if isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
            else:
                messages.append({"role": item.role, "content": _chat_content(item.content)})
    if reasoning:
        assistant_turn("")
    return messages


def _chat_content(content: str | tuple[ContentPart, ...]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    return [_chat_part(part) for part in content]


def _chat_part(part: ContentPart) -> dict[str, Any]:
    if isinstance(part, (InputText, OutputText)):
        return {"type": "text", "text": part.text}
    if isinstance(part, InputImage):
        return {"type": "image_url", "image_url": {"url": part.image_url}}
    return {"type": "video_url", "video_url": {"url": part.video_url}}
