"""What every wire protocol shares: a strict cattrs converter, request errors that name the field, usage details.

Requests are attrs classes structured from the parsed JSON body. The converter built here is strict in the ways a
client can act on: an unknown member is `unknown_parameter`, a missing one `missing_required_parameter`, a value of
the wrong JSON kind `invalid_type` (no "5" for 5, no string iterated as a list), a literal outside its set
`invalid_value`. Every failure carries the member's path in OpenAI's `param` spelling (`messages[2].content`).

Responses and stream events are attrs classes too. Unstructuring follows one rule: a field whose default is None is
left out while it is None (optional request members, optional delta members); a field without a default is always
written, null included (`finish_reason`, `stop_sequence`).
"""

from __future__ import annotations

import functools
import json
import re
import types
import typing
from typing import Any, Callable, Literal, TypeVar

import attrs
import cattrs
from cattrs.errors import AttributeValidationNote, ForbiddenExtraKeysError, IterableValidationNote
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

T = TypeVar("T")


class RequestError(ValueError):
    """A request the protocol refuses: HTTP `status` (400) with `code`. `param` is relative to the object that
    raised it (a validator names its own field); `structure` prefixes the path of that object in the request."""

    def __init__(self, message: str, *, code: str = "invalid_value", param: str | None = None,
                 status: int = 400) -> None:
        super().__init__(message)
        self.message, self.code, self.param, self.status = message, code, param, status


# --- validators ------------------------------------------------------------------------------------------------------
# Records rather than closures, so what a field accepts can be read back (the property tests generate from them).
# Each lets None through: an absent optional member is not a value to check.


@attrs.frozen
class InRange:
    low: float
    high: float

    def __call__(self, _: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and not self.low <= value <= self.high:  # NaN fails too
            raise RequestError(f"must be in [{self.low}, {self.high}], got {value!r}", param=attribute.name)


@attrs.frozen
class AtLeast:
    low: int

    def __call__(self, _: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and value < self.low:
            raise RequestError(f"must be at least {self.low}, got {value!r}", param=attribute.name)


@attrs.frozen
class NonEmpty:
    def __call__(self, _: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and not value:
            raise RequestError("must not be empty", param=attribute.name)


@attrs.frozen
class Matches:
    pattern: re.Pattern
    description: str  # what a match is, for the message

    def __call__(self, _: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and not self.pattern.fullmatch(value):
            raise RequestError(f"{value!r} is not {self.description}", param=attribute.name)


@attrs.frozen(init=False)
class SupportedOnly:
    """A recognized feature this server does not implement: absent, or one of `allowed` (the values that mean "not
    used", e.g. n=1 or logprobs=false); anything else is a field-specific 400 `code` such as n_not_supported."""

    code: str
    allowed: tuple[Any, ...]

    def __init__(self, code: str, *allowed: Any) -> None:
        self.__attrs_init__(code, allowed)

    def __call__(self, _: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and value not in self.allowed:
            raise RequestError(f"{json.dumps(value)} is not supported by this server", code=self.code,
                               param=attribute.name)


# --- the converter ---------------------------------------------------------------------------------------------------

_JSON_KINDS = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
               dict: "an object"}


def _kind_error(expected: type, value: Any) -> RequestError:
    got = "null" if value is None else _JSON_KINDS.get(type(value), type(value).__name__)
    return RequestError(f"expected {_JSON_KINDS[expected]}, got {got}", code="invalid_type")


def _structure_str(value: Any, _: type) -> str:
    if not isinstance(value, str):
        raise _kind_error(str, value)
    return value


def _structure_bool(value: Any, _: type) -> bool:
    if not isinstance(value, bool):
        raise _kind_error(bool, value)
    return value


def _structure_int(value: Any, _: type) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _kind_error(int, value)
    return value


def _structure_float(value: Any, _: type) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _kind_error(float, value)
    return float(value)


def _structure_literal(value: Any, literal: Any) -> Any:
    allowed = typing.get_args(literal)
    # `True in (1,)` holds in Python: compare JSON kinds too.
    if not any(value == a and type(value) is type(a) for a in allowed):
        raise RequestError(f"expected one of {', '.join(json.dumps(a) for a in allowed)}, got {json.dumps(value)}")
    return value


def _is_union(t: Any) -> bool:
    return typing.get_origin(t) in (typing.Union, types.UnionType)


def _is_sequence(t: Any) -> bool:
    return typing.get_origin(t) in (tuple, list)


def _is_mapping(t: Any) -> bool:
    return typing.get_origin(t) is dict


def _json_kind_of(t: Any) -> tuple[type, ...]:
    """The JSON value kinds (as Python types) a member type of a union accepts."""
    if t is Any:
        return (object,)
    if t is type(None):
        return (type(None),)
    if typing.get_origin(t) is Literal:
        return tuple({type(a) for a in typing.get_args(t)})
    if _is_sequence(t):
        return (list,)
    if _is_mapping(t) or attrs.has(t):
        return (dict,)
    return {float: (int, float), int: (int,)}.get(t, (t,))


def _matches(kinds: tuple[type, ...], value: Any) -> bool:
    if isinstance(value, bool):
        return bool in kinds or object in kinds
    return isinstance(value, kinds)


def _describe(t: Any) -> str:
    if typing.get_origin(t) is Literal:
        return " or ".join(json.dumps(a) for a in typing.get_args(t))
    kind = _json_kind_of(t)[-1]
    return "null" if kind is type(None) else _JSON_KINDS.get(kind, "a value")


def make_converter() -> cattrs.Converter:
    """A converter for one protocol: strict JSON kinds, unknown members refused, None-default fields omitted."""
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(str, _structure_str)
    converter.register_structure_hook(bool, _structure_bool)
    converter.register_structure_hook(int, _structure_int)
    converter.register_structure_hook(float, _structure_float)
    converter.register_structure_hook_func(lambda t: typing.get_origin(t) is Literal, _structure_literal)

    def structure_sequence(value: Any, t: Any) -> Any:
        if not isinstance(value, list):
            raise _kind_error(list, value)
        element = typing.get_args(t)[0]
        items, errors = [], []
        for index, item in enumerate(value):
            try:
                items.append(converter.structure(item, element))
            except Exception as exc:  # noqa: BLE001 - collected with its index, as cattrs does for its own hooks
                exc.__notes__ = [*getattr(exc, "__notes__", []),
                                 IterableValidationNote(f"Structuring {t} @ index {index}", index, element)]
                errors.append(exc)
        if errors:
            raise cattrs.IterableValidationError(f"While structuring {t}", errors, t)
        return typing.get_origin(t)(items)

    def structure_mapping(value: Any, t: Any) -> Any:
        if not isinstance(value, dict):
            raise _kind_error(dict, value)
        value_type = typing.get_args(t)[1]
        return {key: converter.structure(item, value_type) for key, item in value.items()}

    def union_hook(union: Any) -> Callable[[Any, Any], Any]:
        members = [(member, _json_kind_of(member)) for member in typing.get_args(union)]

        def structure_union(value: Any, _: Any) -> Any:
            for member, kinds in members:
                if _matches(kinds, value):
                    return None if value is None else converter.structure(value, member)
            expected = " or ".join(_describe(member) for member, _ in members)
            raise RequestError(f"expected {expected}", code="invalid_type")

        return structure_union

    converter.register_structure_hook_func(_is_sequence, structure_sequence)
    converter.register_structure_hook_func(_is_mapping, structure_mapping)
    converter.register_structure_hook_factory(_is_union, union_hook)
    converter.register_unstructure_hook_factory(attrs.has, lambda cls: make_dict_unstructure_fn(
        cls, converter, **{a.name: override(omit_if_default=True) for a in attrs.fields(cls) if a.default is None}))
    return converter


@functools.cache
def _class_structure_fn(converter: cattrs.Converter, cls: type) -> Callable[[Any, type], Any]:
    """The converter's generated structuring of `cls` itself, bypassing hooks registered for `cls` (which call it).
    Made on first use, when every hook its fields need has been registered."""
    return make_dict_structure_fn(cls, converter)


def register_tagged_union(converter: cattrs.Converter, union: Any, classes: dict[Any, type], *, tag: str = "type",
                          unknown_code: str = "invalid_value") -> None:
    """Structure `union` (a union of attrs classes, or one class) by the object's `tag` member; `classes[None]`
    serves objects without one. The tag is read before anything else, so an unsupported variant is a 400
    `unknown_code` on the tag (e.g. `modality_not_supported`) rather than complaints about its other members."""

    def structure(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise _kind_error(dict, value)
        kind = value.get(tag)
        cls = classes.get(kind) if isinstance(kind, (str, type(None))) else None
        if cls is None:
            known = ", ".join(sorted(json.dumps(k) for k in classes if k is not None))
            raise RequestError(f"unsupported {tag} {json.dumps(kind)} (supported: {known})", code=unknown_code,
                               param=tag)
        return _class_structure_fn(converter, cls)(value, cls)

    converter.register_structure_hook_func(lambda t: t == union, structure)


def register_dropping_nulls(converter: cattrs.Converter, cls: type) -> None:
    """Structure `cls` as if its null members were absent (for option bags where null means "not set", so an
    unknown member is refused only when it carries a value)."""

    def structure(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise _kind_error(dict, value)
        return _class_structure_fn(converter, cls)({key: item for key, item in value.items() if item is not None},
                                                   cls)

    converter.register_structure_hook(cls, structure)


# --- structuring with errors a client can act on ---------------------------------------------------------------------


def structure(converter: cattrs.Converter, data: Any, cls: type[T]) -> T:
    """`data` (parsed JSON) as `cls`; any failure is a RequestError naming the first offending member."""
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_type")
    try:
        return converter.structure(data, cls)
    except Exception as exc:  # noqa: BLE001 - cattrs reports every failure as an exception (group)
        raise _request_error(exc, []) from None


def _request_error(exc: BaseException, path: list[str | int]) -> RequestError:
    for note in getattr(exc, "__notes__", []):
        if isinstance(note, AttributeValidationNote):
            path = [*path, note.name]
        elif isinstance(note, IterableValidationNote):
            path = [*path, note.index]
    if isinstance(exc, BaseExceptionGroup):
        # Members the class does not know explain the most (a misspelling makes the real member look missing).
        extra = [e for e in exc.exceptions if isinstance(e, ForbiddenExtraKeysError)]
        return _request_error((extra or exc.exceptions)[0], path)
    if isinstance(exc, ForbiddenExtraKeysError):
        param = param_path([*path, sorted(exc.extra_fields)[0]])
        return RequestError(f"unknown parameter {param!r}", code="unknown_parameter", param=param)
    if isinstance(exc, KeyError):
        param = param_path(path)
        return RequestError(f"missing required parameter {param!r}", code="missing_required_parameter", param=param)
    if isinstance(exc, RequestError):
        param = param_path([*path, *([exc.param] if exc.param else [])]) or None
        return RequestError(f"{param}: {exc.message}" if param else exc.message, code=exc.code, param=param,
                            status=exc.status)
    param = param_path(path) or None
    return RequestError(f"{param or 'body'}: {exc}", code="invalid_type", param=param)


def param_path(path: list[str | int]) -> str:
    """`["messages", 2, "content"]` -> `messages[2].content`."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def to_json(converter: cattrs.Converter, obj: Any) -> str:
    """Compact JSON of a protocol object, non-ASCII text as is (SSE data lines)."""
    return json.dumps(converter.unstructure(obj), ensure_ascii=False, separators=(",", ":"))


# --- usage details (OpenAI's Chat and Responses usage objects both carry these) ---------------------------------------


@attrs.frozen(kw_only=True)
class CachedTokensDetails:
    cached_tokens: int  # the exact resident prompt prefix the engine reused


@attrs.frozen(kw_only=True)
class ReasoningTokensDetails:
    reasoning_tokens: int  # tokens accepted while the reasoning channel was open
