"""Plan the conversion of a llama-architecture GGUF file (llama.cpp's format) into a `.ninfer` artifact.

Weights are dequantized to float32 with the `gguf` package (any GGML type it can dequantize). llama.cpp's converter
permutes the rows of the Q and K projections so that RoPE pairs are interleaved (x0, y0, x1, y1, ...); we undo that so
the weights are in the Hugging Face rotate-half layout that `ops.apply_rotary` expects.

ninfer tensor names for the llama family (shapes are `[rows, cols]`, matrices stored as `[out, in]`):

| name                                        | shape                            | ninfer-v2 format |
|---------------------------------------------|----------------------------------|------------------|
| `text/token_embedding`                      | `[vocab_rows, hidden]`           | W8G32_F16S       |
| `text/layers/{i}/input_norm`                | `[hidden]`                       | BF16             |
| `text/layers/{i}/attention/query_key_value` | `[q_width + 2*kv_width, hidden]` | W8G32_F16S       |
| `text/layers/{i}/attention/output`          | `[hidden, q_width]`              | W8G32_F16S       |
| `text/layers/{i}/post_attention_norm`       | `[hidden]`                       | BF16             |
| `text/layers/{i}/mlp/gate_up`               | `[2*intermediate, hidden]`       | W8G32_F16S       |
| `text/layers/{i}/mlp/down`                  | `[hidden, intermediate]`         | W8G32_F16S       |
| `text/final_norm`                           | `[hidden]`                       | BF16             |
| `text/output_head`                          | `[vocab_rows, hidden]`           | W8G32_F16S       |

Fused rows: query_key_value is query, then key, then value; gate_up is gate, then up. `text/output_head` exists only
when the head is not tied to the embedding (it then gets the embedding's format: the same table either way).

Every matrix is W8 under ninfer-v2: llama models served here are small (the 135M demo), and small models lose too much
at 4-5 bits. Measured on SmolLM2-135M against its bf16 artifact (53-position prompt, argmax agreement / relative L2
of logits): W8 everywhere 98% / 0.026, Q6 91% / 0.11, Q5 81% / 0.27, Q4 57% / 0.35.

Resources, in order: the six `frontend/*` resources of every artifact (tokenizer.json rebuilt from the GGUF's
byte-level BPE vocabulary, tokenizer_config.json, chat_template.jinja, generation_config.json, and `{}` for the two
media preprocessor configs, since a text-only model has none), then `model/dimensions.json`.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from ninfer.convert.plan import BF16, ConversionPlan, PlannedResource, PlannedTensor
from ninfer.targets.dims import DIMENSIONS_RESOURCE, LlamaDims
from ninfer.targets.registry import SMOLLM2_135M_DIMS, lookup_target

W8 = "W8G32_F16S"

# llama.cpp's pre-tokenizer families for byte-level BPE (llama-vocab.cpp). Those in DIGIT_SPLIT_PRE split every digit
# on its own before the GPT-2 regex; the plain ones use the GPT-2 regex alone (ByteLevel's own regex).
DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
PLAIN_GPT2_PRE = frozenset({"default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion"})

# Used only when the GGUF carries no chat template: each message's content, concatenated.
PLAIN_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


class GGUFSourceError(ValueError):
    """The GGUF file is not a llama model ninfer can convert (architecture, tensors, tokenizer, model_id)."""


class _Metadata:
    """A GGUF file's key/value metadata, with a clear error for a missing required key."""

    def __init__(self, reader: gguf.GGUFReader, path: Path) -> None:
        self._fields = reader.fields
        self._path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise GGUFSourceError(f"{self._path}: GGUF metadata lacks {key!r}")
        return self._fields[key].contents()


def _f32_metadata_float(value: float) -> float:
    """GGUF stores these floats as float32: keep the shortest decimal that round-trips (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def undo_rope_permutation(weight: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row permutation: per head, interleaved rows (x0, y0, x1, y1, ...) become halves
    (x0, x1, ..., y0, y1, ...), the rotate-half layout of Hugging Face checkpoints."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


class _Tensors:
    """The GGUF's tensors by name, dequantized to float32 on demand."""

    def __init__(self, reader: gguf.GGUFReader, path: Path) -> None:
        self._by_name = {t.name: t for t in reader.tensors}
        self._path = path

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def names(self) -> set[str]:
        return set(self._by_name)

    def type_counts(self) -> dict[str, int]:
        return dict(sorted(Counter(t.tensor_type.name for t in self._by_name.values()).items()))

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._by_name:
            raise GGUFSourceError(f"{self._path}: missing tensor {name!r}")
        # GGML lists dimensions fastest-first; numpy's (row-major) shape is the reverse.
        return tuple(int(n) for n in reversed(self._by_name[name].shape))

    def load(self, name: str) -> np.ndarray:
        tensor = self._by_name[name]
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise GGUFSourceError(f"{name}: cannot dequantize GGML type {tensor.tensor_type.name} ({exc})") from exc
        return np.asarray(values, dtype=np.float32).reshape(self.shape(name))


def _llama_dims(meta: _Metadata, tensors: _Tensors, vocab_ids: int) -> LlamaDims:
    hidden = int(meta.require("llama.embedding_length"))
    heads = int(meta.require("llama.attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    rotary = int(meta.get("llama.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise GGUFSourceError(f"partial rotary embeddings ({rotary} of {head_dim} dims) are not supported")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensors:
        raise GGUFSourceError(f"RoPE scaling ({scaling}, or a rope_freqs tensor) is not supported")
    vocab_rows = tensors.shape("token_embd.weight")[0]
    if vocab_ids > vocab_rows:
        raise GGUFSourceError(f"the tokenizer has {vocab_ids} tokens but the embedding only {vocab_rows} rows")
    return LlamaDims(
        hidden=hidden,
        layers=int(meta.require("llama.block_count")),
        vocab_rows=vocab_rows,
        vocab_ids=vocab_ids,
        attn_heads=heads,
        kv_heads=int(meta.get("llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate=int(meta.require("llama.feed_forward_length")),
        rope_theta=_f32_metadata_float(meta.get("llama.rope.freq_base", 10000.0)),
        rms_eps=_f32_metadata_float(meta.require("llama.attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in tensors,
    )


def _resolve_model_id(dims: LlamaDims, requested: str | None) -> str:
    if requested is None:
        return "smollm2-135m-instruct" if dims == SMOLLM2_135M_DIMS else "llama-custom"
    try:
        target = lookup_target(requested)
    except LookupError as exc:
        raise GGUFSourceError(str(exc)) from None
    if target.family != "llama":
        raise GGUFSourceError(f"model_id {requested!r} is a {target.family} target; this GGUF is a llama model")
    if target.dims is not None and target.dims != dims:
        raise GGUFSourceError(f"this GGUF's dimensions ({dims}) are not those of {requested!r} ({target.dims})")
    return requested


# ---- tensors -------------------------------------------------------------------------------------------------------


def _planned_tensors(tensors: _Tensors, dims: LlamaDims) -> list[PlannedTensor]:
    hidden, inter = dims.hidden, dims.intermediate
    planned: list[PlannedTensor] = []
    consumed: set[str] = set()

    def plan(name: str, shape: tuple[int, ...], fmt: str, sources: list[str], build: Callable[[], np.ndarray]) -> None:
        consumed.update(sources)
        planned.append(PlannedTensor(name, shape, fmt, build))

    def direct(name: str, source: str, shape: tuple[int, ...], fmt: str) -> None:
        _expect_shape(tensors, source, shape)
        plan(name, shape, fmt, [source], lambda: tensors.load(source))

    direct("text/token_embedding", "token_embd.weight", (dims.vocab_rows, hidden), W8)
    for i in range(dims.layers):
        blk, out = f"blk.{i}", f"text/layers/{i}"
        q, k, v = f"{blk}.attn_q.weight", f"{blk}.attn_k.weight", f"{blk}.attn_v.weight"
        _expect_shape(tensors, q, (dims.q_width, hidden))
        _expect_shape(tensors, k, (dims.kv_width, hidden))
        _expect_shape(tensors, v, (dims.kv_width, hidden))
        gate, up = f"{blk}.ffn_gate.weight", f"{blk}.ffn_up.weight"
        _expect_shape(tensors, gate, (inter, hidden))
        _expect_shape(tensors, up, (inter, hidden))

        direct(f"{out}/input_norm", f"{blk}.attn_norm.weight", (hidden,), BF16)
        plan(f"{out}/attention/query_key_value", (dims.q_width + 2 * dims.kv_width, hidden), W8, [q, k, v],
             lambda q=q, k=k, v=v: np.concatenate([
                 undo_rope_permutation(tensors.load(q), dims.attn_heads),
                 undo_rope_permutation(tensors.load(k), dims.kv_heads),
                 tensors.load(v),
             ]))
        direct(f"{out}/attention/output", f"{blk}.attn_output.weight", (hidden, dims.q_width), W8)
        direct(f"{out}/post_attention_norm", f"{blk}.ffn_norm.weight", (hidden,), BF16)
        plan(f"{out}/mlp/gate_up", (2 * inter, hidden), W8, [gate, up],
             lambda gate=gate, up=up: np.concatenate([tensors.load(gate), tensors.load(up)]))
        direct(f"{out}/mlp/down", f"{blk}.ffn_down.weight", (hidden, inter), W8)
    direct("text/final_norm", "output_norm.weight", (hidden,), BF16)
    if not dims.tie_embeddings:
        direct("text/output_head", "output.weight", (dims.vocab_rows, hidden), W8)

    unused = tensors.names() - consumed
    if unused:
        raise GGUFSourceError(f"unsupported tensors in this GGUF: {sorted(unused)[:8]}")
    return planned


def _expect_shape(tensors: _Tensors, name: str, shape: tuple[int, ...]) -> None:
    found = tensors.shape(name)
    if found != shape:
        raise GGUFSourceError(f"{name}: shape {list(found)} does not match the metadata's {list(shape)}")


# ---- frontend resources --------------------------------------------------------------------------------------------


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in PLAIN_GPT2_PRE:
        return byte_level
    supported = ", ".join(sorted(DIGIT_SPLIT_PRE | PLAIN_GPT2_PRE))
    raise GGUFSourceError(f"unsupported tokenizer.ggml.pre {pre!r} (supported: {supported})")


def _tokenizer_json(tokens: list[str], token_types: list[int], merges: list[str], pre: str) -> bytes:
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFSourceError("tokenizer.ggml.tokens has duplicate entries")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges]))
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (<|im_start|>, ...) are special: matched whole in text and skipped when decoding.
    # User-defined tokens are matched whole too but are ordinary text.
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, t in enumerate(token_types) if t == gguf.TokenType.CONTROL])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i, t in enumerate(token_types) if t == gguf.TokenType.USER_DEFINED])
    return tokenizer.to_str().encode("utf-8")


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _frontend_resources(meta: _Metadata) -> tuple[list[PlannedResource], int]:
    """The six frontend resources, and the number of token ids the tokenizer can emit."""
    model = meta.require("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFSourceError(f"tokenizer.ggml.model {model!r}: only byte-level BPE ('gpt2') tokenizers are supported")
    tokens = list(meta.require("tokenizer.ggml.tokens"))
    token_types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [gguf.TokenType.NORMAL] * len(tokens))]
    merges = list(meta.require("tokenizer.ggml.merges"))
    template = meta.get("tokenizer.chat_template") or PLAIN_CHAT_TEMPLATE

    def token(key: str) -> str | None:
        token_id = meta.get(key)
        return None if token_id is None else tokens[int(token_id)]

    eos_ids = [int(meta.require("tokenizer.ggml.eos_token_id"))]
    chatml = "<|im_start|>" in template and "<|im_end|>" in template and "<|im_end|>" in tokens
    if chatml and tokens.index("<|im_end|>") not in eos_ids:
        eos_ids.append(tokens.index("<|im_end|>"))  # ChatML turns end with <|im_end|>: it must stop generation

    added = {str(i): {"content": tokens[i], "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": t == gguf.TokenType.CONTROL}
             for i, t in enumerate(token_types) if t in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)}
    tokenizer_config = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "model_max_length": int(meta.get("llama.context_length", 2048)),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "tokenizer_class": "GPT2Tokenizer",
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
    }
    generation_config = {"eos_token_id": eos_ids}
    for key, meta_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                          ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if meta.get(meta_key) is not None:
            generation_config[key] = int(meta.get(meta_key))
    resources = [
        PlannedResource("frontend/tokenizer.json",
                        _tokenizer_json(tokens, token_types, merges, meta.get("tokenizer.ggml.pre", "default"))),
        PlannedResource("frontend/tokenizer_config.json", _json_bytes(tokenizer_config)),
        PlannedResource("frontend/chat_template.jinja", template.encode("utf-8")),
        PlannedResource("frontend/generation_config.json", _json_bytes(dict(sorted(generation_config.items())))),
        PlannedResource("frontend/preprocessor_config.json", b"{}"),
        PlannedResource("frontend/video_preprocessor_config.json", b"{}"),
    ]
    return resources, len(tokens)


# ---- the plan ------------------------------------------------------------------------------------------------------


def plan_gguf_llama(gguf_path: Path, *, model_id: str | None = None) -> ConversionPlan:
    """The conversion plan of a llama-architecture GGUF file; tensors are read and dequantized when produced."""
    path = Path(gguf_path)
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise GGUFSourceError(f"{path}: not a readable GGUF file ({exc})") from exc
    meta = _Metadata(reader, path)
    arch = meta.require("general.architecture")
    if arch != "llama":
        raise GGUFSourceError(f"{path}: architecture {arch!r}; only 'llama' GGUF files are supported")
    tensors = _Tensors(reader, path)
    resources, vocab_ids = _frontend_resources(meta)
    dims = _llama_dims(meta, tensors, vocab_ids)
    model_id = _resolve_model_id(dims, model_id)
    resources.append(PlannedResource(DIMENSIONS_RESOURCE, dims.to_json().encode("utf-8")))
    return ConversionPlan(
        model_id=model_id,
        resources=tuple(resources),
        tensors=tuple(_planned_tensors(tensors, dims)),
        source={
            "kind": "gguf",
            "path": str(path.resolve()),
            "source_bytes": path.stat().st_size,
            "name": meta.get("general.name"),
            "architecture": arch,
            "ggml_types": tensors.type_counts(),
        },
        target_key=model_id.replace("-", "_").replace(".", "_"),
    )
