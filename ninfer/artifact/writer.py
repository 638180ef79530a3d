"""Streaming `.ninfer` v1 writer: the directory is planned up front, then payloads are written one at a time."""

from __future__ import annotations

import json
import operator
import os
import struct
from typing import Iterable, Sequence

import attrs
import numpy as np

from ninfer.artifact import codec
from ninfer.artifact.errors import ArtifactError, ArtifactFormatError, ArtifactUsageError
from ninfer.artifact.formats import PAYLOAD_ALIGNMENT, RAW_BYTES, align_up, alignment, check_shape, encoded_size, is_valid_text, layout_for

MAGIC = b"NINFER\x00\x01"
PREFIX = struct.Struct("<8sQ")  # magic, then the byte length of the JSON directory


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


@attrs.frozen
class _PlannedObject:
    spec: TensorSpec | ResourceSpec
    offset: int  # relative to the payload start
    nbytes: int

    def directory_entry(self) -> dict:
        spec = self.spec
        if isinstance(spec, ResourceSpec):
            return {"name": spec.name, "kind": "resource", "encoding": RAW_BYTES, "offset": self.offset, "bytes": self.nbytes}
        return {
            "name": spec.name,
            "kind": "tensor",
            "shape": list(spec.shape),
            "format": spec.format,
            "layout": layout_for(spec.format),
            "offset": self.offset,
            "bytes": self.nbytes,
        }


def plan_objects(objects: Sequence[TensorSpec | ResourceSpec]) -> list[_PlannedObject]:
    """Offsets and sizes in directory order: each object at the first aligned offset after the previous one."""
    if not objects:
        raise ArtifactFormatError("json-schema", "an artifact needs at least one object")
    planned, names, cursor = [], set(), 0
    for spec in objects:
        try:
            nbytes = _planned_size(spec)
        except ArtifactError as err:
            raise err.for_object(spec.name) from None
        if spec.name in names:
            raise ArtifactFormatError("duplicate-name", "object names must be unique", spec.name)
        names.add(spec.name)
        kind_alignment = alignment(RAW_BYTES if isinstance(spec, ResourceSpec) else layout_for(spec.format))
        offset = align_up(cursor, kind_alignment)
        planned.append(_PlannedObject(spec, offset, nbytes))
        cursor = offset + nbytes
    return planned


def _planned_size(spec: TensorSpec | ResourceSpec) -> int:
    if not is_valid_text(spec.name):
        raise ArtifactFormatError("json-schema", "object names must be non-empty strings")
    if isinstance(spec, ResourceSpec):
        if type(spec.nbytes) is not int or spec.nbytes <= 0:
            raise ArtifactFormatError("json-schema", f"resource size must be a positive integer, got {spec.nbytes!r}")
        return spec.nbytes
    check_shape(spec.format, spec.shape)
    return encoded_size(spec.format, spec.shape)


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
        directory = {"model_id": model_id, "objects": [obj.directory_entry() for obj in self._planned]}
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
        planned = self._planned[self._next]
        try:
            data = self._payload_bytes(planned, payload)
        except ArtifactError as err:
            raise err.for_object(planned.spec.name) from None
        self._file.write(bytes(self._payload_offset + planned.offset - self._file.tell()))  # alignment gap
        self._file.write(data)
        self._next += 1

    @staticmethod
    def _payload_bytes(planned: _PlannedObject, payload: bytes | np.ndarray) -> memoryview:
        spec = planned.spec
        if isinstance(payload, np.ndarray):
            if isinstance(spec, ResourceSpec):
                raise ArtifactUsageError("payload-type", "a resource payload must be bytes")
            if payload.shape != spec.shape:
                raise ArtifactUsageError("shape-mismatch", f"array shape {list(payload.shape)} != {list(spec.shape)}")
            return memoryview(codec.encode_buffer(payload, spec.format))
        data = memoryview(payload).cast("B")
        if data.nbytes != planned.nbytes:
            raise ArtifactUsageError("bytes-mismatch", f"payload has {data.nbytes} bytes, planned {planned.nbytes}")
        return data

    def close(self) -> None:
        if self._file.closed:
            return
        if self._next != len(self._planned):
            missing = self._planned[self._next].spec.name
            raise ArtifactUsageError("incomplete", f"{len(self._planned) - self._next} payloads not written", missing)
        self._file.truncate()  # the file ends exactly at the end of the last object
        self._file.close()


def write_artifact(path, model_id: str, items: Iterable[tuple[TensorSpec | ResourceSpec, bytes | np.ndarray]]) -> None:
    """Write a whole artifact from (spec, payload) pairs; holds every payload, so meant for small files and tests."""
    items = list(items)
    with ArtifactWriter(path, model_id, [spec for spec, _ in items]) as writer:
        for _, payload in items:
            writer.write_next(payload)
