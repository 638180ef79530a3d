"""Streaming `.ninfer` v1 writer: the directory is planned up front, then payloads are written one at a time."""

from __future__ import annotations

import json
import operator
import os
from typing import Iterable, Iterator, Sequence

import attrs
import numpy as np

from ninfer.artifact import codec
from ninfer.artifact.errors import ArtifactError, ArtifactFormatError, ArtifactUsageError
from ninfer.artifact.formats import (
    MAGIC,
    PAYLOAD_ALIGNMENT,
    PREFIX,
    RAW_BYTES,
    align_up,
    alignment,
    encoded_size,
    is_valid_text,
    layout_for,
)
from ninfer.artifact.reader import ObjectEntry


def _as_shape(shape: Iterable[int]) -> tuple[int, ...]:
    return tuple(operator.index(extent) for extent in shape)  # accepts numpy integers, rejects floats


@attrs.frozen
class TensorSpec:
    name: str
    shape: tuple[int, ...] = attrs.field(converter=_as_shape)
    format: str


@attrs.frozen
class ResourceSpec:
    name: str
    nbytes: int  # resource payload size, known before anything is written


def plan_objects(objects: Sequence[TensorSpec | ResourceSpec]) -> list[ObjectEntry]:
    """Directory entries in order: each object at the first aligned offset after the previous one."""
    if not objects:
        raise ArtifactFormatError("json-schema", "an artifact needs at least one object")
    planned, names, cursor = [], set(), 0
    for spec in objects:
        try:
            entry = _entry_at(spec, cursor)
        except ArtifactError as err:
            raise err.for_object(spec.name) from None
        if spec.name in names:
            raise ArtifactFormatError("duplicate-name", "object names must be unique", spec.name)
        names.add(spec.name)
        planned.append(entry)
        cursor = entry.offset + entry.nbytes
    return planned


def _entry_at(spec: TensorSpec | ResourceSpec, cursor: int) -> ObjectEntry:
    """The entry of `spec`, placed at the first offset at or after `cursor` that its layout allows."""
    if not is_valid_text(spec.name):
        raise ArtifactFormatError("json-schema", "object names must be non-empty strings")
    if isinstance(spec, ResourceSpec):
        if type(spec.nbytes) is not int or spec.nbytes <= 0:
            raise ArtifactFormatError("json-schema", f"resource size must be a positive integer, got {spec.nbytes!r}")
        offset = align_up(cursor, alignment(RAW_BYTES))
        return ObjectEntry(spec.name, "resource", (), None, RAW_BYTES, offset, spec.nbytes)
    layout = layout_for(spec.format)
    offset, nbytes = align_up(cursor, alignment(layout)), encoded_size(spec.format, spec.shape)
    return ObjectEntry(spec.name, "tensor", spec.shape, spec.format, layout, offset, nbytes)


class ArtifactWriter:
    """Writes one artifact, holding at most one payload in memory.

    The prefix, directory and padding are written on construction; `write_next` then takes each object's payload in
    directory order and `close` checks that all were written. Leaving a `with` block by an exception removes the
    partial file, which could otherwise be mistaken for an artifact.
    """

    def __init__(self, path, model_id: str, objects: Sequence[TensorSpec | ResourceSpec]) -> None:
        if not is_valid_text(model_id):
            raise ArtifactFormatError("json-schema", "model_id must be a non-empty string")
        self._path = os.fspath(path)
        self._planned = plan_objects(objects)
        directory = {"model_id": model_id, "objects": [entry.to_json() for entry in self._planned]}
        text = json.dumps(directory, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        self._payload_offset = align_up(PREFIX.size + len(text), PAYLOAD_ALIGNMENT)
        self._next = 0
        self._file = open(self._path, "wb")
        self._file.write(PREFIX.pack(MAGIC, len(text)) + text)
        self._file.write(bytes(self._payload_offset - PREFIX.size - len(text)))

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._discard()
            return
        try:
            self.close()
        except ArtifactError:
            self._discard()
            raise

    def _discard(self) -> None:
        self._file.close()
        os.unlink(self._path)

    def write_next(self, payload: bytes | np.ndarray) -> None:
        """Write the payload of the next object: encoded bytes of the planned size, or an array to encode."""
        if self._next >= len(self._planned):
            raise ArtifactUsageError("too-many-payloads", f"all {len(self._planned)} objects are already written")
        entry = self._planned[self._next]
        self._file.write(bytes(self._payload_offset + entry.offset - self._file.tell()))  # alignment gap
        try:
            for piece in self._payload_pieces(entry, payload):
                self._file.write(piece)
        except ArtifactError as err:
            raise err.for_object(entry.name) from None
        self._next += 1

    @staticmethod
    def _payload_pieces(entry: ObjectEntry, payload: bytes | np.ndarray) -> Iterator[memoryview]:
        """The payload's bytes in order; an array is checked, then encoded piece by piece as it is written."""
        if isinstance(payload, (np.ndarray, np.generic)):  # numpy scalars are arrays of shape ()
            payload = np.asarray(payload)
            if entry.kind == "resource":
                raise ArtifactUsageError("payload-type", "a resource payload must be bytes")
            if payload.shape != entry.shape:
                raise ArtifactUsageError("shape-mismatch", f"array shape {list(payload.shape)} != {list(entry.shape)}")
            return (memoryview(piece) for piece in codec.encode_chunks(payload, entry.format))
        data = memoryview(payload).cast("B")
        if data.nbytes != entry.nbytes:
            raise ArtifactUsageError("bytes-mismatch", f"payload has {data.nbytes} bytes, planned {entry.nbytes}")
        return iter((data,))

    def close(self) -> None:
        if self._file.closed:
            return
        if self._next != len(self._planned):
            missing = self._planned[self._next].name
            raise ArtifactUsageError("incomplete", f"{len(self._planned) - self._next} payloads not written", missing)
        self._file.truncate()  # the file ends exactly at the end of the last object
        self._file.close()


def write_artifact(path, model_id: str, items: Iterable[tuple[TensorSpec | ResourceSpec, bytes | np.ndarray]]) -> None:
    """Write a whole artifact from (spec, payload) pairs; holds every payload, so meant for small files and tests."""
    items = list(items)
    with ArtifactWriter(path, model_id, [spec for spec, _ in items]) as writer:
        for _, payload in items:
            writer.write_next(payload)
