"""Our sandboxed rendering of the official Qwen3.5, Qwen3.6 and Qwen3.8 templates equals transformers'
`apply_chat_template`, text and token ids, over a generated matrix of conversations and template options.

The matrix covers tool definitions, tool-call history with argument values of every JSON type, several calls in one
turn, consecutive tool results, `<tool_response>` user turns, reasoning_content (and inline <think> content) on
assistant turns before and after the last user query, image/video parts, add_vision_id, enable_thinking on/off,
preserve_thinking on/off/unset, every reasoning_effort the template accepts (and an unknown one), generation prompt on
and off, and conversations the templates reject (which must be rejected by both).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import attrs
import pytest

from ninfer.frontend.chat import ChatTemplate, ChatTemplateError
from ninfer.frontend.prompt import PromptBuilder, PromptOptions
from ninfer.frontend.tokenizer import Tokenizer
from tests.support.qwen_tokenizer import TOKENIZER_CONFIG

transformers = pytest.importorskip("transformers")
jinja2 = pytest.importorskip("jinja2")

FIXTURES = Path(__file__).parent / "fixtures" / "qwen"
MODELS = ["Qwen3.5-0.8B", "Qwen3.6-27B", "Qwen3.8-27B"]
CASES_PER_TEMPLATE = 1000
EFFORTS = ["low", "medium", "xhigh"]  # what the Qwen3.8 template accepts; the others ignore the variable

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_docs", "description": "Recherche — 検索 <b>&</b>",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1},
            "filters": {"type": "object", "properties": {"lang": {"enum": ["en", "zh"]}}},
            "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["query"]}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]
ARGUMENT_VALUES = [
    "Paris", "multi\nline\n  value ", "", "42", '{"looks": "like json"}', "東京 🌸", "<tool_call>",
    0, 7, -123456789012345, 3.14, -0.5, 1e-07, 2.5e20, True, False, None,
    [], [1, "two", 3.0, None, True], [[1, 2], {"k": "v"}],
    {}, {"nested": {"deep": [1, {"x": None}]}, "ünï": "côdé"},
]
TEXTS = ["hello", "  padded text  ", "你好，简单介绍一下你自己。", "emoji 👩‍💻🏽 and ZWJ", "line1\nline2\n\n",
         "<think>not really</think>", "Tool output looks like <tool_response>x</tool_response>", "数字 1234567890"]
REASONING = ["step one, then two", "  \nspaced reasoning\n ", "", "推理过程"]


@attrs.frozen
class Case:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    add_generation_prompt: bool
    enable_thinking: bool
    extra: dict[str, Any]  # preserve_thinking, reasoning_effort, add_vision_id, when set


def _content(rng: random.Random, media: bool) -> str | list[dict[str, Any]]:
    if not media or rng.random() < 0.6:
        return rng.choice(TEXTS)
    parts: list[dict[str, Any]] = []
    for _ in range(rng.randint(1, 4)):
        parts.append(rng.choice([
            {"type": "text", "text": rng.choice(TEXTS)}, {"type": "image"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, {"type": "video"},
            {"type": "video", "video": "clip.mp4"}, {"type": "image", "image": "cat.png"}]))
    return parts


def _tool_call(rng: random.Random) -> dict[str, Any]:
    name = rng.choice(["get_weather", "search_docs", "noop"])
    arguments = {f"arg_{k}": rng.choice(ARGUMENT_VALUES) for k in range(rng.randint(0, 4))}
    function: dict[str, Any] = {"name": name, "arguments": arguments}
    if rng.random() < 0.1:
        del function["arguments"]
    return {"type": "function", "id": f"call_{rng.randint(0, 999)}", "function": function} if rng.random() < 0.8 \
        else function  # the templates also read a flat call


def _assistant(rng: random.Random, with_calls: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": rng.choice(["", "Let me check.", "Done: 42.", None])}
    roll = rng.random()
    if roll < 0.5:
        message["reasoning_content"] = rng.choice(REASONING)
    elif roll < 0.65 and message["content"]:
        message["content"] = f"<think>\n{rng.choice(REASONING)}\n</think>\n\n{message['content']}"  # inline reasoning
    if with_calls:
        message["tool_calls"] = [_tool_call(rng) for _ in range(rng.randint(1, 3))]
    return message


def _conversation(rng: random.Random) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(
            ["You are helpful.", "", "  系统提示  ", [{"type": "text", "text": "parts"}, {"type": "text", "text": "!"}]])})
    messages.append({"role": "user", "content": _content(rng, media=True)})
    for _ in range(rng.randint(0, 5)):
        kind = rng.choice(["chat", "tools", "tools", "tool_response_user"])
        if kind == "chat":
            messages += [_assistant(rng, with_calls=False), {"role": "user", "content": _content(rng, media=True)}]
        elif kind == "tools":
            call = _assistant(rng, with_calls=True)
            results = [{"role": "tool", "tool_call_id": "call_1", "content": _content(rng, media=rng.random() < 0.2)}
                       for _ in call["tool_calls"]]
            messages += [call, *results]
        else:
            messages += [_assistant(rng, with_calls=False),
                         {"role": "user", "content": "<tool_response>\nresult\n</tool_response>"}]
    if rng.random() < 0.25:
        messages.append(_assistant(rng, with_calls=False))  # a closed final turn (e.g. add_generation_prompt off)
    return messages


def _invalid(rng: random.Random, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation each template rejects."""
    return rng.choice([
        messages + [{"role": "system", "content": "late system"}],
        [{"role": "assistant", "content": "no user turn"}],
        [{"role": "user", "content": "<tool_response>only a tool response</tool_response>"}],
        messages + [{"role": "critic", "content": "unknown role"}],
        [{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": [{"type": "audio"}]}],
        [],
    ])


def parity_cases(model: str, count: int = CASES_PER_TEMPLATE, seed: int = 7) -> list[Case]:
    rng = random.Random(f"{model}-{seed}")
    cases = []
    for k in range(count):
        messages = _conversation(rng)
        if k % 16 == 15:
            messages = _invalid(rng, messages)
        extra: dict[str, Any] = {}
        preserve = rng.choice([True, False, None])
        if preserve is not None:
            extra["preserve_thinking"] = preserve
        effort = rng.choice([None, None, *EFFORTS, "ultra"] if k % 16 != 14 else ["ultra"])
        if effort is not None:
            extra["reasoning_effort"] = effort
        if rng.random() < 0.15:
            extra["add_vision_id"] = True
        tools = rng.sample(TOOLS, rng.randint(1, len(TOOLS))) if rng.random() < 0.5 else None
        cases.append(Case(messages, tools, rng.random() < 0.85, rng.random() < 0.6, extra))
    return cases


def _template(model: str) -> str:
    return (FIXTURES / model / "chat_template.jinja").read_text()


@pytest.fixture(scope="module")
def hf_tokenizer(qwen_tokenizer_json: Path, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("hf-qwen-tokenizer")
    (folder / "tokenizer.json").symlink_to(qwen_tokenizer_json)  # 33 MB: link, not copy
    shutil.copy(TOKENIZER_CONFIG, folder / "tokenizer_config.json")
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer_json: Path) -> Tokenizer:
    return Tokenizer(qwen_tokenizer_json.read_bytes(), TOKENIZER_CONFIG.read_bytes())


def _hf_render(hf_tokenizer, source: str, case: Case, tokenize: bool):
    return hf_tokenizer.apply_chat_template(
        case.messages, tools=case.tools, chat_template=source, add_generation_prompt=case.add_generation_prompt,
        enable_thinking=case.enable_thinking, tokenize=tokenize, return_dict=False, **case.extra)


@pytest.mark.parametrize("model", MODELS)
def test_text_and_ids_equal_transformers(model: str, hf_tokenizer, tokenizer: Tokenizer) -> None:
    source = _template(model)
    ours = ChatTemplate(source)
    rendered = rejected = 0
    for case in parity_cases(model):
        try:
            expected = _hf_render(hf_tokenizer, source, case, tokenize=False)
        except (jinja2.TemplateError, ValueError):  # transformers refuses an empty conversation itself
            with pytest.raises(ChatTemplateError):
                ours.render(case.messages, tools=case.tools, add_generation_prompt=case.add_generation_prompt,
                            enable_thinking=case.enable_thinking, **case.extra)
            rejected += 1
            continue
        text = ours.render(case.messages, tools=case.tools, add_generation_prompt=case.add_generation_prompt,
                           enable_thinking=case.enable_thinking, **case.extra)
        assert text == expected, case
        assert tokenizer.encode(text) == _hf_render(hf_tokenizer, source, case, tokenize=True), case
        rendered += 1
    assert rendered >= CASES_PER_TEMPLATE * 0.75 and rejected >= CASES_PER_TEMPLATE // 20, (rendered, rejected)


def _has_adjacent_text_parts(messages: list[dict[str, Any]]) -> bool:
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(a.get("type") == b.get("type") == "text"
                                             for a, b in zip(content, content[1:])):
            return True
    return False


@pytest.mark.parametrize("model", MODELS)
def test_prompt_builder_renders_like_the_template(model: str, hf_tokenizer, tokenizer: Tokenizer) -> None:
    """Without later system messages, prompt assembly adds nothing to what transformers renders (its one deliberate
    difference, joining adjacent text parts with a newline, is left out of this comparison)."""
    source = _template(model)
    builder = PromptBuilder(ChatTemplate(source), tokenizer)
    compared = 0
    for case in parity_cases(model):
        # The builder always passes preserve_thinking and never add_vision_id (not a serving option); later system
        # messages and rejected conversations have their own tests.
        if ("preserve_thinking" not in case.extra or case.extra.get("reasoning_effort") == "ultra"
                or "add_vision_id" in case.extra or _has_adjacent_text_parts(case.messages)
                or any(m.get("role") == "system" for m in case.messages[1:])):
            continue
        try:
            expected = _hf_render(hf_tokenizer, source, case, tokenize=True)
        except (jinja2.TemplateError, ValueError):  # transformers refuses an empty conversation itself
            continue
        options = PromptOptions(case.enable_thinking, case.extra["preserve_thinking"],
                                case.extra.get("reasoning_effort"))
        prompt = builder.build(case.messages, options, tools=case.tools,
                               add_generation_prompt=case.add_generation_prompt)
        assert list(prompt.ids) == expected, case
        compared += 1
    assert compared >= CASES_PER_TEMPLATE // 4
