"""Writer and reader of the `.ninfer` v1 container (§2.1-2.3): exact bytes, round trips, and every rejection rule."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from ninfer.artifact import (
    BF16,
    FP32,
    I32,
    Q4G64,
    Q5G64,
    Q6G64,
    W8G32,
    Artifact,
    ArtifactError,
    ArtifactWriter,
    ResourceSpec,
    TensorSpec,
    decode,
    encode,
    write_artifact,
)
from ninfer.artifact.formats import MAGIC


def compact(directory: dict) -> bytes:
    return json.dumps(directory, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def raw_file(text: bytes, payload: bytes, *, json_bytes: int | None = None) -> bytes:
    """A file framed by hand: prefix, directory text, zero padding to 4096, payload."""
    head = struct.pack("<8sQ", MAGIC, len(text) if json_bytes is None else json_bytes) + text
    return head + bytes(-len(head) % 4096) + payload


# --- exact bytes ----------------------------------------------------------------------------------------------------


def test_writer_emits_the_exact_container_bytes(tmp_path):
    path = tmp_path / "tiny.ninfer"
    write_artifact(
        path,
        "qwen3.6-27b",
        [
            (ResourceSpec("frontend/é.json", 3), b"abc"),
            (TensorSpec("t", (2,), FP32), np.array([1.0, 2.0], np.float32)),
        ],
    )
    text = (
        '{"model_id":"qwen3.6-27b","objects":['
        '{"name":"frontend/é.json","kind":"resource","encoding":"raw-bytes-v1","offset":0,"bytes":3},'
        '{"name":"t","kind":"tensor","shape":[2],"format":"FP32","layout":"contiguous-le-v1","offset":256,"bytes":8}]}'
    ).encode("utf-8")
    expected = b"NINFER\x00\x01" + struct.pack("<Q", len(text)) + text
    expected += bytes(4096 - len(expected)) + b"abc" + bytes(253) + struct.pack("<2f", 1.0, 2.0)
    assert path.read_bytes() == expected


def test_writer_plans_aligned_offsets_and_ends_at_the_last_object(tmp_path):
    path = tmp_path / "plan.ninfer"
    specs = [
        ResourceSpec("a", 5),
        ResourceSpec("b", 7),  # raw bytes need no alignment: right after "a"
        TensorSpec("q", (3, 130), Q5G64),  # 256-aligned
        TensorSpec("s", (), BF16),
        ResourceSpec("c", 1),
    ]
    with ArtifactWriter(path, "m", specs) as writer:
        writer.write_next(b"AAAAA")
        writer.write_next(bytearray(b"BBBBBBB"))
        writer.write_next(np.ones((3, 130), np.float32))
        writer.write_next(np.float32(2.0))
        writer.write_next(memoryview(b"C"))
    with Artifact.open(path) as artifact:
        offsets = [(entry.offset, entry.nbytes) for entry in artifact.objects]
        assert offsets == [(0, 5), (5, 7), (256, 792), (1280, 2), (1282, 1)]
        assert artifact.file_size == artifact.payload_offset + 1283
        data = path.read_bytes()
        gap = data[artifact.payload_offset + 12 : artifact.payload_offset + 256]
        assert gap == bytes(len(gap))


# --- round trips ----------------------------------------------------------------------------------------------------


def mixed_items(rng: np.random.Generator) -> list[tuple]:
    items = [(ResourceSpec("frontend/tokenizer.json", 11), b'{"a": "b"}\n')]
    for index, fmt in enumerate((Q4G64, Q5G64, Q6G64, W8G32)):
        shape = (int(rng.integers(1, 20)), int(rng.integers(1, 400)))
        items.append((TensorSpec(f"text/q{index}", shape, fmt), rng.standard_normal(shape).astype(np.float32)))
    items.append((TensorSpec("text/norm", (33,), BF16), rng.standard_normal(33).astype(np.float32)))
    items.append((TensorSpec("text/scalar", (), FP32), np.float32(0.25)))
    items.append((TensorSpec("text/deep", (1,) * 15 + (3,), FP32), rng.standard_normal((1,) * 15 + (3,))))
    items.append((TensorSpec("text/ids", (5,), I32), np.array([0, 7, -3, 2**31 - 1, -(2**31)])))
    items.append((ResourceSpec("frontend/chat_template.jinja", 1), b"x"))
    return items


def test_mixed_file_round_trips(tmp_path):
    path = tmp_path / "mixed.ninfer"
    items = mixed_items(np.random.default_rng(0))
    write_artifact(path, "qwen3.6-35b-a3b", items)
    with Artifact.open(path) as artifact:
        assert artifact.model_id == "qwen3.6-35b-a3b"
        assert [entry.name for entry in artifact.objects] == [spec.name for spec, _ in items]
        for spec, payload in items:
            assert spec.name in artifact
            if isinstance(spec, ResourceSpec):
                assert artifact.resource(spec.name) == payload
                assert artifact.entry(spec.name).encoding == "raw-bytes-v1"
                continue
            view = artifact.tensor(spec.name)
            assert (view.format, view.shape) == (spec.format, spec.shape)
            assert bytes(view.raw) == encode(np.asarray(payload), spec.format)
            full = view.to_numpy()
            assert np.array_equal(full, decode(encode(np.asarray(payload), spec.format), spec.format, spec.shape))
            if spec.shape:
                middle = spec.shape[0] // 2
                assert np.array_equal(view.rows(middle, spec.shape[0] - middle), full[middle:])


def test_reader_api_errors(tmp_path):
    path = tmp_path / "api.ninfer"
    items = mixed_items(np.random.default_rng(1))
    write_artifact(path, "m", items)
    norm = next(payload for spec, payload in items if spec.name == "text/norm")
    artifact = Artifact.open(path)
    with pytest.raises(KeyError) as err:
        artifact.entry("nope")
    assert isinstance(err.value, ArtifactError) and err.value.rule == "missing-object"
    assert err.value.object_name == "nope" and "nope" in str(err.value)
    assert "nope" not in artifact
    with pytest.raises(ArtifactError) as err:
        artifact.tensor("frontend/tokenizer.json")
    assert err.value.rule == "wrong-kind"
    with pytest.raises(ArtifactError) as err:
        artifact.resource("text/norm")
    assert err.value.rule == "wrong-kind"
    with pytest.raises(ArtifactError) as err:
        artifact.tensor("text/scalar").rows(0, 1)
    assert (err.value.rule, err.value.object_name) == ("row-range", "text/scalar")
    held = artifact.tensor("text/norm").raw  # a caller still holding a zero-copy view must not break close
    artifact.close()
    artifact.close()
    assert bytes(held) == encode(norm, BF16)
    with pytest.raises(ArtifactError) as err:
        artifact.tensor("text/norm")
    assert err.value.rule == "closed"


# --- writer misuse --------------------------------------------------------------------------------------------------


def rule_of(call) -> tuple[str, str | None]:
    with pytest.raises(ArtifactError) as err:
        call()
    return err.value.rule, err.value.object_name


def test_writer_rejects_bad_plans(tmp_path):
    path = tmp_path / "x.ninfer"
    assert rule_of(lambda: ArtifactWriter(path, "m", [])) == ("json-schema", None)
    assert rule_of(lambda: ArtifactWriter(path, "", [ResourceSpec("r", 1)])) == ("json-schema", None)
    twice = [ResourceSpec("r", 1), ResourceSpec("r", 1)]
    assert rule_of(lambda: ArtifactWriter(path, "m", twice)) == ("duplicate-name", "r")
    assert rule_of(lambda: ArtifactWriter(path, "m", [ResourceSpec("r", 0)])) == ("json-schema", "r")
    assert rule_of(lambda: ArtifactWriter(path, "m", [TensorSpec("t", (4,), "Q3")])) == ("unknown-format", "t")
    assert rule_of(lambda: ArtifactWriter(path, "m", [TensorSpec("t", (64,), Q4G64)])) == ("rank", "t")
    assert rule_of(lambda: ArtifactWriter(path, "m", [TensorSpec("t", (4, 0), BF16)])) == ("shape", "t")
    assert rule_of(lambda: ArtifactWriter(path, "m", [TensorSpec("t", (1,) * 17, BF16)])) == ("rank", "t")
    assert not path.exists()


def test_writer_rejects_bad_payloads(tmp_path):
    path = tmp_path / "x.ninfer"
    specs = [TensorSpec("t", (2, 64), Q4G64), ResourceSpec("r", 2)]
    writer = ArtifactWriter(path, "m", specs)
    assert rule_of(lambda: writer.write_next(b"short")) == ("bytes-mismatch", "t")
    assert rule_of(lambda: writer.write_next(np.zeros((2, 63), np.float32))) == ("shape-mismatch", "t")
    nan = np.zeros((2, 64), np.float32)
    nan[1, 1] = np.nan
    assert rule_of(lambda: writer.write_next(nan)) == ("non-finite", "t")
    writer.write_next(np.zeros((2, 64), np.float32))
    assert rule_of(lambda: writer.write_next(np.zeros(2, np.uint8))) == ("payload-type", "r")
    assert rule_of(writer.close) == ("incomplete", "r")
    writer.write_next(b"ok")
    assert rule_of(lambda: writer.write_next(b"more")) == ("too-many-payloads", None)
    writer.close()
    with Artifact.open(path) as artifact:
        assert artifact.resource("r") == b"ok"


def test_writer_removes_the_partial_file_when_a_with_block_fails(tmp_path):
    path = tmp_path / "partial.ninfer"
    with pytest.raises(ArtifactError):
        with ArtifactWriter(path, "m", [ResourceSpec("a", 1), ResourceSpec("b", 1)]) as writer:
            writer.write_next(b"a")
    assert not path.exists()
    with pytest.raises(RuntimeError):
        with ArtifactWriter(path, "m", [ResourceSpec("a", 1)]):
            raise RuntimeError("converter failed")
    assert not path.exists()


# --- reader rejections ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> tuple[dict, bytes]:
    """A valid artifact's directory and payload: resource r @0 (5 B), FP32 t [2,3] @256, Q4 q [2,64] @512."""
    path = tmp_path_factory.mktemp("valid") / "valid.ninfer"
    write_artifact(
        path,
        "qwen3.6-27b",
        [
            (ResourceSpec("r", 5), b"hello"),
            (TensorSpec("t", (2, 3), FP32), np.arange(6, dtype=np.float32).reshape(2, 3)),
            (TensorSpec("q", (2, 64), Q4G64), np.full((2, 64), 7.0, np.float32)),  # scale exactly 1.0
        ],
    )
    data = path.read_bytes()
    (json_bytes,) = struct.unpack_from("<Q", data, 8)
    return json.loads(data[16 : 16 + json_bytes]), data[4096:]


def open_bytes(tmp_path, data: bytes) -> Artifact:
    path = tmp_path / "case.ninfer"
    path.write_bytes(data)
    return Artifact.open(path)


def rejection(tmp_path, data: bytes) -> tuple[str, str | None]:
    with pytest.raises(ArtifactError) as err:
        open_bytes(tmp_path, data).close()
    assert err.value.rule in str(err.value)
    if err.value.object_name is not None:
        assert repr(err.value.object_name) in str(err.value)
    return err.value.rule, err.value.object_name


def edited(valid, edit) -> bytes:
    directory, payload = json.loads(json.dumps(valid[0])), valid[1]
    edit(directory)
    return raw_file(compact(directory), payload)


def test_the_unedited_fixture_opens(tmp_path, valid):
    with open_bytes(tmp_path, edited(valid, lambda d: None)) as artifact:
        assert artifact.tensor("t").to_numpy().tolist() == [[0, 1, 2], [3, 4, 5]]


HUGE_LITERAL = b"9" * 5000 + b","  # beyond Python's int-from-string digit limit
FRAMING_CASES = {
    "bad magic": (lambda d, p: b"NINFEX\x00\x01" + raw_file(compact(d), p)[8:], "magic"),
    "framing revision 2": (lambda d, p: b"NINFER\x00\x02" + raw_file(compact(d), p)[8:], "magic"),
    "shorter than the prefix": (lambda d, p: MAGIC + b"\x01\x00", "truncated"),
    "empty file": (lambda d, p: b"", "truncated"),
    "json_bytes is zero": (lambda d, p: raw_file(b"", p, json_bytes=0), "json-length"),
    "shorter than payload_offset": (lambda d, p: raw_file(compact(d), p)[:4095], "truncated"),
    "json_bytes past the end": (lambda d, p: raw_file(compact(d), p, json_bytes=2**63), "truncated"),
    "invalid UTF-8": (lambda d, p: raw_file(compact(d).replace(b'"r"', b'"\xff"'), p), "utf-8"),
    "invalid JSON": (lambda d, p: raw_file(compact(d)[:-1], p), "json-syntax"),
    "NaN constant": (lambda d, p: raw_file(compact(d).replace(b'"offset":0', b'"offset":NaN'), p), "json-syntax"),
    "trailing text": (lambda d, p: raw_file(compact(d) + b"x", p), "json-syntax"),
    "huge integer literal": (lambda d, p: raw_file(compact(d).replace(b":0,", b":" + HUGE_LITERAL), p), "json-syntax"),
    "deep nesting": (lambda d, p: raw_file(b"[" * 100000 + b"]" * 100000, p), "json-syntax"),
    "lone surrogate in a name": (lambda d, p: raw_file(compact(d).replace(b'"t"', b'"\\ud800"'), p), "json-schema"),
    "repeated member": (lambda d, p: raw_file(compact(d)[:-1] + b',"model_id":"x"}', p), "json-schema"),
}


@pytest.mark.parametrize("case", FRAMING_CASES)
def test_framing_and_syntax_rejections(tmp_path, valid, case):
    build, rule = FRAMING_CASES[case]
    assert rejection(tmp_path, build(json.loads(json.dumps(valid[0])), valid[1])) == (rule, None)


def _set(index: int, member: str, value):
    def edit(directory):
        directory["objects"][index][member] = value

    return edit


def _delete(index: int, member: str):
    return lambda directory: directory["objects"][index].pop(member)


def _root(member: str, value):
    return lambda directory: directory.__setitem__(member, value)


DIRECTORY_CASES = {
    # root schema
    "root extra member": (_root("version", 1), "json-schema", None),
    "root missing objects": (lambda d: d.pop("objects"), "json-schema", None),
    "root is an array": (lambda d: (d.clear(), d.__setitem__("objects", [])), "json-schema", None),
    "empty model_id": (_root("model_id", ""), "json-schema", None),
    "null model_id": (_root("model_id", None), "json-schema", None),
    "numeric model_id": (_root("model_id", 27), "json-schema", None),
    "empty objects": (_root("objects", []), "json-schema", None),
    "objects not an array": (_root("objects", {"r": 1}), "json-schema", None),
    "object not a JSON object": (lambda d: d["objects"].__setitem__(1, ["t"]), "json-schema", None),
    # member sets and types
    "extra tensor member": (_set(1, "dtype", "f32"), "json-schema", "t"),
    "extra resource member": (_set(0, "shape", []), "json-schema", "r"),
    "missing layout": (_delete(1, "layout"), "json-schema", "t"),
    "missing bytes": (_delete(0, "bytes"), "json-schema", "r"),
    "null shape": (_set(1, "shape", None), "json-schema", "t"),
    "null format": (_set(1, "format", None), "json-schema", "t"),
    "null encoding": (_set(0, "encoding", None), "json-schema", "r"),
    "shape as a string": (_set(1, "shape", "2,3"), "json-schema", "t"),
    "bool in shape": (_set(1, "shape", [2, True]), "json-schema", "t"),
    "float in shape": (_set(1, "shape", [2, 3.0]), "json-schema", "t"),
    "float offset": (_set(1, "offset", 256.0), "json-schema", "t"),
    "bool bytes": (_set(0, "bytes", True), "json-schema", "r"),
    "string offset": (_set(2, "offset", "512"), "json-schema", "q"),
    "negative offset": (_set(0, "offset", -1), "json-schema", "r"),
    "zero bytes": (_set(0, "bytes", 0), "json-schema", "r"),
    "empty name": (_set(1, "name", ""), "json-schema", None),
    "numeric name": (_set(1, "name", 7), "json-schema", None),
    "unknown kind": (_set(1, "kind", "blob"), "json-schema", "t"),
    "null kind": (_set(1, "kind", None), "json-schema", "t"),
    "duplicate name": (_set(2, "name", "t"), "duplicate-name", "t"),
    # registries
    "unknown format": (_set(1, "format", "FP16"), "unknown-format", "t"),
    "lower-case format": (_set(1, "format", "fp32"), "unknown-format", "t"),
    "unknown layout": (_set(1, "layout", "column-split-v1"), "unknown-layout", "t"),
    "unknown encoding": (_set(0, "encoding", "gzip-v1"), "unknown-encoding", "r"),
    "quantized in contiguous layout": (_set(2, "layout", "contiguous-le-v1"), "format-layout", "q"),
    "FP32 in row-split layout": (_set(1, "layout", "row-split-k128-v1"), "format-layout", "t"),
    # shapes and sizes
    "row-split rank 3": (_set(2, "shape", [2, 64, 1]), "rank", "q"),
    "row-split rank 1": (_set(2, "shape", [128]), "rank", "q"),
    "contiguous rank 17": (_set(1, "shape", [1] * 17), "rank", "t"),
    "zero extent": (_set(1, "shape", [2, 0]), "shape", "t"),
    "negative extent": (_set(1, "shape", [-2, -3]), "shape", "t"),
    "bytes != encoded size": (_set(1, "bytes", 28), "bytes-mismatch", "t"),
    "shape disagrees with bytes": (_set(2, "shape", [2, 200]), "bytes-mismatch", "q"),
    # geometry
    "out of physical order": (_set(2, "offset", 0), "order", "q"),
    "overlap": (_set(1, "offset", 0), "overlap", "t"),
    "misaligned tensor": (_set(2, "offset", 640), "alignment", "q"),
    "past the end": (_set(2, "offset", 2**40), "out-of-bounds", "q"),
    "huge offset": (_set(2, "offset", 10**30), "out-of-bounds", "q"),
    "huge consistent shape": (lambda d: d["objects"][1].update(shape=[10**20], bytes=4 * 10**20), "out-of-bounds", "t"),
}


@pytest.mark.parametrize("case", DIRECTORY_CASES)
def test_directory_rejections(tmp_path, valid, case):
    edit, rule, name = DIRECTORY_CASES[case]
    assert rejection(tmp_path, edited(valid, edit)) == (rule, name)


def test_truncated_payload_is_out_of_bounds(tmp_path, valid):
    assert rejection(tmp_path, raw_file(compact(valid[0]), valid[1][:-1])) == ("out-of-bounds", "q")


def test_spelling_padding_and_trailing_bytes_are_not_normative(tmp_path, valid):
    directory, payload = valid
    text = b' {\n "objects" : ' + json.dumps(directory["objects"], indent=1).encode() + b', "model_id": "m"}\n'
    data = bytearray(raw_file(text, payload))
    data[2000:2100] = b"\xaa" * 100  # padding bytes have no meaning
    with open_bytes(tmp_path, bytes(data) + b"trailing bytes are allowed") as artifact:
        assert artifact.model_id == "m" and artifact.resource("r") == b"hello"


def test_resources_need_no_alignment_and_gaps_may_be_wide(tmp_path, valid):
    directory, payload = valid
    t_bytes, q_bytes = payload[256 : 256 + 24], payload[512 : 512 + 264]
    directory = json.loads(json.dumps(directory))
    for entry, offset in zip(directory["objects"], (3, 512, 1024)):
        entry["offset"] = offset
    moved = bytes(3) + b"hello" + bytes(504) + t_bytes + bytes(488) + q_bytes
    with open_bytes(tmp_path, raw_file(compact(directory), moved)) as artifact:
        assert artifact.resource("r") == b"hello"
        assert artifact.tensor("t").to_numpy().tolist() == [[0, 1, 2], [3, 4, 5]]
        assert (artifact.tensor("q").to_numpy() == 7).all()


def test_row_split_layout_and_decoding_errors_name_the_object(tmp_path, valid):
    directory, payload = valid
    q = directory["objects"][2]
    poisoned = bytearray(payload)
    poisoned[q["offset"] + 256 : q["offset"] + 258] = struct.pack("<H", 0x7C00)  # +inf scale of q's first group
    with open_bytes(tmp_path, raw_file(compact(directory), bytes(poisoned))) as artifact:
        for read in (lambda: artifact.tensor("q").to_numpy(), lambda: artifact.tensor("q").rows(0, 1)):
            with pytest.raises(ArtifactError) as err:
                read()
            assert (err.value.rule, err.value.object_name) == ("bad-scale", "q")
        assert np.array_equal(artifact.tensor("q").rows(1, 1), np.full((1, 64), 7.0, np.float32))
