"""Memory-mapped `.ninfer` v1 reader.

`Artifact.open` validates everything the directory promises (framing, the closed JSON schemas, registries and
geometry, ninfer-facts §2.1-2.3) before returning; payload contents are only looked at when a tensor is decoded.
"""

from __future__ import annotations

import json
import mmap
import os

import attrs
import numpy as np

from ninfer.artifact import codec
from ninfer.artifact.errors import (
    ArtifactError,
    ArtifactFormatError,
    ArtifactGeometryError,
    ArtifactUsageError,
    MissingObjectError,
)
from ninfer.artifact.formats import (
    ENCODINGS,
    FORMATS,
    LAYOUTS,
    MAGIC,
    PAYLOAD_ALIGNMENT,
    PREFIX,
    align_up,
    alignment,
    check_shape,
    encoded_size,
    is_valid_text,
    layout_for,
)

TENSOR_MEMBERS = ("name", "kind", "shape", "format", "layout", "offset", "bytes")
RESOURCE_MEMBERS = ("name", "kind", "encoding", "offset", "bytes")


@attrs.frozen
class ObjectEntry:
    """One directory entry, validated."""

    name: str
    kind: str  # "tensor" or "resource"
    shape: tuple[int, ...]  # () for resources
    format: str | None  # None for resources
    layout: str  # the tensor layout, or the resource encoding
    offset: int  # relative to the payload start
    nbytes: int

    @property
    def encoding(self) -> str | None:
        return self.layout if self.kind == "resource" else None

    def to_json(self) -> dict:
        """The directory member, with the members in the order the writer emits them."""
        if self.kind == "resource":
            return {
                "name": self.name,
                "kind": "resource",
                "encoding": self.layout,
                "offset": self.offset,
                "bytes": self.nbytes,
            }
        return {
            "name": self.name,
            "kind": "tensor",
            "shape": list(self.shape),
            "format": self.format,
            "layout": self.layout,
            "offset": self.offset,
            "bytes": self.nbytes,
        }


@attrs.frozen(eq=False)
class TensorView:
    """A tensor's payload, zero-copy from the mapping, with decoding on demand."""

    name: str
    format: str
    layout: str
    shape: tuple[int, ...]
    nbytes: int
    raw: memoryview

    def to_numpy(self) -> np.ndarray:
        """The whole tensor: float32 (quantized formats dequantized) or int32."""
        try:
            return codec.decode(self.raw, self.format, self.shape)
        except ArtifactError as err:
            raise err.for_object(self.name) from None

    def rows(self, start: int, count: int) -> np.ndarray:
        """Rows [start, start+count) along the first axis, reading only their bytes."""
        try:
            return codec.decode_rows(self.raw, self.format, self.shape, start, count)
        except ArtifactError as err:
            raise err.for_object(self.name) from None


class Artifact:
    """An open artifact: its validated directory and a read-only mapping of the file."""

    def __init__(self, path: str, mapping: mmap.mmap, model_id: str, objects: tuple[ObjectEntry, ...], json_bytes: int):
        self.path = path
        self.model_id = model_id
        self.objects = objects
        self.json_bytes = json_bytes
        self.payload_offset = align_up(PREFIX.size + json_bytes, PAYLOAD_ALIGNMENT)
        self.file_size = len(mapping)
        self._mapping = mapping
        self._view: memoryview | None = memoryview(mapping)
        self._by_name = {entry.name: entry for entry in objects}

    @classmethod
    def open(cls, path) -> Artifact:
        path = os.fspath(path)
        with open(path, "rb") as file:
            file_size = os.fstat(file.fileno()).st_size
            json_bytes = _read_prefix(file.read(PREFIX.size), file_size)
            mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            model_id, objects = parse_directory(mapping[PREFIX.size : PREFIX.size + json_bytes])
            check_geometry(objects, file_size - align_up(PREFIX.size + json_bytes, PAYLOAD_ALIGNMENT))
        except BaseException:
            mapping.close()
            raise
        return cls(path, mapping, model_id, objects, json_bytes)

    def __enter__(self) -> Artifact:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __contains__(self, name) -> bool:
        return name in self._by_name

    def entry(self, name: str) -> ObjectEntry:
        try:
            return self._by_name[name]
        except (KeyError, TypeError):
            raise MissingObjectError("missing-object", "no such object in the artifact", name) from None

    def tensor(self, name: str) -> TensorView:
        entry = self._entry_of_kind(name, "tensor")
        return TensorView(entry.name, entry.format, entry.layout, entry.shape, entry.nbytes, self._payload(entry))

    def resource(self, name: str) -> bytes:
        return bytes(self._payload(self._entry_of_kind(name, "resource")))

    def close(self) -> None:
        if self._view is None:
            return
        self._view.release()
        self._view = None
        try:
            self._mapping.close()
        except BufferError:
            pass  # a caller still holds a TensorView.raw; the mapping goes away with the last such view

    def _entry_of_kind(self, name: str, kind: str) -> ObjectEntry:
        entry = self.entry(name)
        if entry.kind != kind:
            raise ArtifactUsageError("wrong-kind", f"is a {entry.kind}, not a {kind}", name)
        return entry

    def _payload(self, entry: ObjectEntry) -> memoryview:
        if self._view is None:
            raise ArtifactUsageError("closed", "the artifact is closed", entry.name)
        start = self.payload_offset + entry.offset
        return self._view[start : start + entry.nbytes]


def _read_prefix(prefix: bytes, file_size: int) -> int:
    """The JSON directory length, after checking the magic and that the file reaches the payload start."""
    if len(prefix) < PREFIX.size:
        raise ArtifactFormatError("truncated", f"file has {file_size} bytes, less than the {PREFIX.size}-byte prefix")
    magic, json_bytes = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ArtifactFormatError("magic", f"bad magic {magic.hex()} (expected {MAGIC.hex()})")
    if json_bytes == 0:
        raise ArtifactFormatError("json-length", "the JSON directory length is zero")
    payload_offset = align_up(PREFIX.size + json_bytes, PAYLOAD_ALIGNMENT)
    if file_size < payload_offset:
        raise ArtifactFormatError("truncated", f"file ends at {file_size}, before payload offset {payload_offset}")
    return json_bytes


def parse_directory(text: bytes) -> tuple[str, tuple[ObjectEntry, ...]]:
    """model_id and entries of a JSON directory, each checked against the closed schemas and the registries."""
    try:
        root = json.loads(text.decode("utf-8"), object_pairs_hook=_unique_members, parse_constant=_reject_constant)
    except UnicodeDecodeError as err:
        raise ArtifactFormatError("utf-8", f"the directory is not UTF-8 ({err.reason} at byte {err.start})") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError, over-long integer literals, absurd nesting
        raise ArtifactFormatError("json-syntax", f"the directory is not valid JSON ({err})") from None
    if not isinstance(root, dict) or set(root) != {"model_id", "objects"}:
        raise ArtifactFormatError("json-schema", 'the root must be exactly {"model_id", "objects"}')
    if not is_valid_text(root["model_id"]):
        raise ArtifactFormatError("json-schema", "model_id must be a non-empty string")
    if not isinstance(root["objects"], list) or not root["objects"]:
        raise ArtifactFormatError("json-schema", "objects must be a non-empty array")
    entries = tuple(_parse_object(index, member) for index, member in enumerate(root["objects"]))
    seen = set()
    for entry in entries:
        if entry.name in seen:
            raise ArtifactFormatError("duplicate-name", "object names must be unique", entry.name)
        seen.add(entry.name)
    return root["model_id"], entries


def _unique_members(pairs: list[tuple[str, object]]) -> dict:
    members = dict(pairs)
    if len(members) != len(pairs):
        raise ArtifactFormatError("json-schema", "a JSON object repeats a member name")
    return members


def _reject_constant(constant: str) -> None:
    raise ArtifactFormatError("json-syntax", f"{constant} is not JSON")


def _is_int(value: object) -> bool:
    return type(value) is int  # JSON integers only: bools and floats are not


def _parse_object(index: int, member: object) -> ObjectEntry:
    if not isinstance(member, dict):
        raise ArtifactFormatError("json-schema", f"objects[{index}] is not a JSON object")
    name = member.get("name")
    if not is_valid_text(name):
        raise ArtifactFormatError("json-schema", f"objects[{index}] needs a non-empty string name")
    kind = member.get("kind")
    expected = {"tensor": TENSOR_MEMBERS, "resource": RESOURCE_MEMBERS}.get(kind) if isinstance(kind, str) else None
    if expected is None:
        raise ArtifactFormatError("json-schema", f'kind must be "tensor" or "resource", got {kind!r}', name)
    if set(member) != set(expected):
        missing, extra = sorted(set(expected) - set(member)), sorted(set(member) - set(expected))
        raise ArtifactFormatError("json-schema", f"{kind} members: missing {missing}, unexpected {extra}", name)
    offset, nbytes = member["offset"], member["bytes"]
    if not _is_int(offset) or offset < 0:
        raise ArtifactFormatError("json-schema", f"offset must be a non-negative integer, got {offset!r}", name)
    if not _is_int(nbytes) or nbytes <= 0:
        raise ArtifactFormatError("json-schema", f"bytes must be a positive integer, got {nbytes!r}", name)
    try:
        return _parse_tensor(name, member) if kind == "tensor" else _parse_resource(name, member)
    except ArtifactError as err:
        raise err.for_object(name) from None


def _parse_tensor(name: str, member: dict) -> ObjectEntry:
    shape, fmt, layout, nbytes = member["shape"], member["format"], member["layout"], member["bytes"]
    if not isinstance(shape, list) or not all(_is_int(extent) for extent in shape):
        raise ArtifactFormatError("json-schema", f"shape must be an array of integers, got {shape!r}")
    if not isinstance(fmt, str) or not isinstance(layout, str):
        raise ArtifactFormatError("json-schema", "format and layout must be strings")
    if fmt not in FORMATS:
        raise ArtifactFormatError("unknown-format", f"unknown tensor format {fmt!r}")
    if layout not in LAYOUTS:
        raise ArtifactFormatError("unknown-layout", f"unknown tensor layout {layout!r}")
    if layout != layout_for(fmt):
        raise ArtifactFormatError("format-layout", f"{fmt} is stored in {layout_for(fmt)}, not {layout}")
    shape = tuple(shape)
    check_shape(fmt, shape)
    expected = encoded_size(fmt, shape)
    if nbytes != expected:
        raise ArtifactGeometryError("bytes-mismatch", f"{fmt} {list(shape)} takes {expected} bytes, not {nbytes}")
    return ObjectEntry(name, "tensor", shape, fmt, layout, member["offset"], nbytes)


def _parse_resource(name: str, member: dict) -> ObjectEntry:
    encoding = member["encoding"]
    if not isinstance(encoding, str):
        raise ArtifactFormatError("json-schema", f"encoding must be a string, got {encoding!r}")
    if encoding not in ENCODINGS:
        raise ArtifactFormatError("unknown-encoding", f"unknown resource encoding {encoding!r}")
    return ObjectEntry(name, "resource", (), None, encoding, member["offset"], member["bytes"])


def check_geometry(objects: tuple[ObjectEntry, ...], payload_bytes: int) -> None:
    """§2.3: objects in physical order, aligned, non-overlapping and inside the payload region."""
    cursor, previous_offset = 0, 0
    for entry in objects:
        offset, end, name = entry.offset, entry.offset + entry.nbytes, entry.name
        if offset < previous_offset:
            raise ArtifactGeometryError("order", f"offset {offset} is before the previous object's", name)
        if offset < cursor:
            raise ArtifactGeometryError("overlap", f"offset {offset} is inside the previous object (to {cursor})", name)
        if offset % alignment(entry.layout):
            raise ArtifactGeometryError("alignment", f"offset {offset} is not {alignment(entry.layout)}-aligned", name)
        if end > payload_bytes:
            raise ArtifactGeometryError("out-of-bounds", f"ends at {end}, past the {payload_bytes} payload bytes", name)
        cursor, previous_offset = end, offset
