"""Mutated artifacts: whatever the damage, opening and reading every object succeeds or raises ArtifactError."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer.artifact import Artifact, ArtifactError, ResourceSpec, TensorSpec, encoded_size, write_artifact
from ninfer.artifact.formats import ENCODINGS, FORMATS, LAYOUTS, QUANT_FORMATS

NAMES = ("name", "kind", "shape", "format", "layout", "encoding", "offset", "bytes", "model_id", "objects")

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-300, 5000)
    | st.integers(-(2**80), 2**80)
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(FORMATS + LAYOUTS + ENCODINGS + ("tensor", "resource", "")),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=4), children, max_size=3),
    max_leaves=8,
)


@st.composite
def artifact_items(draw) -> list[tuple]:
    """1-4 small objects of any kind and format, with seeded random contents."""
    items = []
    for index in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            data = draw(st.binary(min_size=1, max_size=40))
            items.append((ResourceSpec(f"resource/{index}", len(data)), data))
            continue
        fmt = draw(st.sampled_from(FORMATS))
        if fmt in QUANT_FORMATS:
            shape = (draw(st.integers(1, 4)), draw(st.integers(1, 140)))
        else:
            shape = tuple(draw(st.lists(st.integers(1, 4), max_size=3)))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        values = rng.integers(-1000, 1000, size=shape) if fmt == "I32" else rng.standard_normal(shape)
        items.append((TensorSpec(f"tensor/{index}", shape, fmt), values))
    return items


def frame(text: bytes, payload: bytes) -> bytes:
    head = struct.pack("<8sQ", b"NINFER\x00\x01", len(text)) + text
    return head + bytes(-len(head) % 4096) + payload


def split(data: bytes) -> tuple[dict, bytes]:
    (json_bytes,) = struct.unpack_from("<Q", data, 8)
    return json.loads(data[16 : 16 + json_bytes]), data[-(-(16 + json_bytes) // 4096) * 4096 :]


def edit_directory(draw, data: bytes) -> bytes:
    """One edit of the directory: delete, add or retype a member, or a plausible change to an object's geometry."""
    directory, payload = split(data)
    objects = directory["objects"]
    target = draw(st.sampled_from([directory] + objects))
    action = draw(st.sampled_from(["delete", "set", "set", "shift", "resize", "rename", "reshape", "reformat"]))
    if action == "delete":
        target.pop(draw(st.sampled_from(sorted(target))))
    elif action == "set":
        target[draw(st.sampled_from(NAMES) | st.text(max_size=4))] = draw(json_values)
    elif target is directory:
        directory["objects"] = draw(st.permutations(objects))
    elif action == "shift":
        target["offset"] += draw(st.sampled_from([-512, -256, -1, 1, 128, 256, 4096]))
    elif action == "resize":
        target["bytes"] += draw(st.integers(-3, 300))
    elif action == "rename":
        target["name"] = draw(st.sampled_from([entry["name"] for entry in objects]))
    elif "shape" in target:
        if action == "reshape":
            target["shape"] = draw(st.lists(st.integers(-2, 300), max_size=4))
        else:
            target["format"] = draw(st.sampled_from(FORMATS))
            target["layout"] = "row-split-k128-v1" if target["format"] in QUANT_FORMATS else "contiguous-le-v1"
        try:
            target["bytes"] = encoded_size(target["format"], tuple(target["shape"]))
        except ArtifactError:
            pass
    ensure_ascii = draw(st.booleans())  # escaped text can smuggle lone surrogates into strings
    return frame(json.dumps(directory, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass"), payload)


def region(draw, data: bytes) -> tuple[int, int]:
    """A span of the file to damage: the prefix, the directory text (likelier), the payload (likelier) or anywhere."""
    (json_bytes,) = struct.unpack_from("<Q", data, 8)
    payload, text = (-(-(16 + json_bytes) // 4096) * 4096, len(data)), (16, 16 + json_bytes)
    return draw(st.sampled_from([(0, 16), text, text, payload, payload, payload, (0, len(data))]))


def position_in(draw, span: tuple[int, int]) -> int:
    return draw(st.integers(span[0], max(span[0], span[1] - 1)))


def mutate(draw, data: bytes) -> bytes:
    kind = draw(st.sampled_from(["flip", "overwrite", "truncate", "append", "directory", "directory", "text"]))
    if kind == "flip":
        mutated, span = bytearray(data), region(draw, data)
        for _ in range(draw(st.integers(1, 8))):
            mutated[min(position_in(draw, span), len(data) - 1)] ^= 1 << draw(st.integers(0, 7))
        return bytes(mutated)
    if kind == "overwrite":
        position = position_in(draw, region(draw, data))
        # besides random bytes: binary16 +inf / NaN / negative scales, and the forbidden W8 code 0x80
        special = st.sampled_from([b"\x00\x7c", b"\x00\x7e", b"\x00\xbc", b"\x80"])
        patch = draw(st.binary(min_size=1, max_size=16) | special)
        return data[:position] + patch + data[position + len(patch) :]
    if kind == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    if kind == "append":
        return data + draw(st.binary(min_size=1, max_size=300))
    if kind == "directory":
        return edit_directory(draw, data)
    (json_bytes,) = struct.unpack_from("<Q", data, 8)
    text, payload = data[16 : 16 + json_bytes], data[-(-(16 + json_bytes) // 4096) * 4096 :]
    cut = draw(st.integers(0, len(text)))
    inserted = draw(st.sampled_from([b"", b",", b"]", b"}", b"-", b"0", b"\xc3", b"\\u"]) | st.binary(max_size=4))
    return frame(text[:cut] + inserted + text[cut + draw(st.integers(0, 3)) :], payload)


def read_object(artifact: Artifact, name: str) -> None:
    """Read one object every way the API offers."""
    entry = artifact.entry(name)
    if entry.kind == "resource":
        assert len(artifact.resource(name)) == entry.nbytes
        return
    view = artifact.tensor(name)
    full = view.to_numpy()
    assert full.shape == view.shape and bytes(view.raw) is not None
    if view.shape:
        middle = view.shape[0] // 2
        assert np.array_equal(view.rows(middle, view.shape[0] - middle), full[middle:], equal_nan=True)


def read_tolerantly(path) -> None:
    """Open and read every object, where ArtifactError is the only acceptable failure."""
    try:
        artifact = Artifact.open(path)
    except ArtifactError:
        return
    with artifact:
        assert isinstance(artifact.model_id, str) and artifact.objects
        for entry in artifact.objects:
            try:
                read_object(artifact, entry.name)
            except ArtifactError:
                pass


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("mutations")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=artifact_items(), data=st.data())
def test_mutated_artifacts_only_ever_raise_artifact_error(workdir, items, data):
    path = workdir / "case.ninfer"
    write_artifact(path, "qwen3.6-27b", items)
    with Artifact.open(path) as artifact:  # the unmutated file reads cleanly
        for spec, _ in items:
            read_object(artifact, spec.name)
    path.write_bytes(mutate(data.draw, path.read_bytes()))
    read_tolerantly(path)
