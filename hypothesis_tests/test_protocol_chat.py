"""Every Chat Completions wire object round-trips: unstructured to JSON text and structured back it is the same
object. A request refuses an unknown member wherever it sits, naming its path.

Objects are generated from the classes themselves (`instances`): field types give the shapes, and the validator
records of ninfer.protocol.common give the values a field accepts. What a class checks across fields is met by
rejection, or by a strategy given for that type.
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from typing import Any, Literal

import attrs
import pytest
from hypothesis import given, reject, settings, strategies as st

from ninfer.protocol import openai_chat
from ninfer.protocol.common import (AtLeast, InRange, Matches, NonEmpty, RequestError, SupportedOnly, param_path,
                                    structure)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6)
PLAIN = {str: st.text(max_size=8), int: st.integers(0, 10**6), float: st.floats(-1e6, 1e6), bool: st.booleans(),
         type(None): st.none(), Any: json_values}
Overrides = dict[Any, st.SearchStrategy]


def strategy_for(t: Any, overrides: Overrides) -> st.SearchStrategy:
    if t in overrides:
        return overrides[t]
    if attrs.has(t):
        return instances(t, overrides)
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([strategy_for(a, overrides) for a in args])
    if origin is Literal:
        return st.sampled_from(args)
    if origin in (tuple, list):
        return st.lists(strategy_for(args[0], overrides), max_size=3).map(origin)
    if origin is dict:
        return st.dictionaries(st.text(max_size=4), strategy_for(args[1], overrides), max_size=3)
    return PLAIN[t]


def _field_strategy(field: attrs.Attribute, overrides: Overrides) -> st.SearchStrategy:
    check = field.validator
    numbers = [a for a in typing.get_args(field.type) if a in (int, float)] or [field.type]
    optional = st.none() if field.default is None else st.nothing()
    if isinstance(check, SupportedOnly):
        return st.sampled_from([None, *check.allowed])
    if isinstance(check, InRange):
        values = st.integers(int(check.low), int(check.high)) if numbers[0] is int else \
            st.floats(check.low, check.high)
        return optional | values
    if isinstance(check, AtLeast):
        return optional | st.integers(check.low, check.low + 10**6)
    if isinstance(check, Matches):
        return st.from_regex(check.pattern, fullmatch=True)
    values = strategy_for(field.type, overrides)
    return values.filter(bool) if isinstance(check, NonEmpty) else values


def instances(cls: type, overrides: Overrides | None = None) -> st.SearchStrategy:
    """Valid instances of an attrs protocol class."""
    overrides = overrides or {}
    attrs.resolve_types(cls)
    fields = {f.name: _field_strategy(f, overrides) for f in attrs.fields(cls)}

    @st.composite
    def build(draw):
        try:
            return cls(**{name: draw(strategy) for name, strategy in fields.items()})
        except RequestError:  # a check across fields
            reject()

    return build()


def protocol_classes(module) -> list[type]:
    return [c for _, c in inspect.getmembers(module, inspect.isclass)
            if attrs.has(c) and c.__module__ == module.__name__]


def round_trips(converter, cls: type, obj: Any) -> None:
    wire = json.loads(json.dumps(converter.unstructure(obj)))
    assert structure(converter, wire, cls) == obj
    assert converter.unstructure(structure(converter, wire, cls)) == converter.unstructure(obj)


def object_paths(obj: Any, path: list[str | int]):
    """(path, attrs object) for `obj` and every protocol object inside it: where an unknown member may go."""
    if attrs.has(type(obj)):
        yield path, obj
        for field in attrs.fields(type(obj)):
            yield from object_paths(getattr(obj, field.name), [*path, field.name])
    elif isinstance(obj, tuple):
        for index, item in enumerate(obj):
            yield from object_paths(item, [*path, index])


def refuses_unknown_members(converter, cls: type, obj: Any, pick: int) -> None:
    paths = list(object_paths(obj, []))
    path, _ = paths[pick % len(paths)]
    wire = converter.unstructure(obj)
    target = wire
    for part in path:
        target = target[part]
    target["zz_unknown"] = 1
    with pytest.raises(RequestError) as raised:
        structure(converter, wire, cls)
    expected = param_path([*path, "zz_unknown"])
    assert (raised.value.code, raised.value.param) == ("unknown_parameter", expected)


CLASSES = {cls: instances(cls) for cls in protocol_classes(openai_chat)}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_chat_object_round_trips(cls, data):
    round_trips(openai_chat.CONVERTER, cls, data.draw(CLASSES[cls]))


@settings(max_examples=100, deadline=None)
@given(request=CLASSES[openai_chat.ChatCompletionRequest], pick=st.integers(0, 10**6))
def test_an_unknown_member_anywhere_is_named(request, pick):
    refuses_unknown_members(openai_chat.CONVERTER, openai_chat.ChatCompletionRequest, request, pick)


@settings(max_examples=30, deadline=None)
@given(request=CLASSES[openai_chat.ChatCompletionRequest], value=st.sampled_from(["1", 1.5, [], {}, True]))
def test_a_wrong_kind_for_max_tokens_is_invalid_type(request, value):
    wire = openai_chat.CONVERTER.unstructure(request)
    wire["max_tokens"] = value
    with pytest.raises(RequestError) as raised:
        structure(openai_chat.CONVERTER, wire, openai_chat.ChatCompletionRequest)
    assert (raised.value.code, raised.value.param) == ("invalid_type", "max_tokens")
