"""GGUF llama conversion and the CPU LlamaModel, checked against transformers' LlamaForCausalLM.

A tiny random llama is written as a GGUF the way llama.cpp's converter writes one (Q/K rows permuted for its
interleaved RoPE, a mix of F32, F16 and Q8_0 tensors, byte-level BPE tokenizer metadata), converted to `.ninfer`, and
run. The transformers model gets exactly the values the artifact stores (bf16 of what the GGUF decodes to), so the
only difference left is fp32 arithmetic order.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from ninfer.artifact.reader import Artifact
from ninfer.cli.main import main
from ninfer.convert.driver import convert
from ninfer.convert.gguf_llama import GGUFSourceError, plan_gguf_llama, undo_rope_permutation
from ninfer.models.base import DictWeights
from ninfer.models.llama import LlamaModel
from ninfer.models.loader import load_model
from ninfer.targets.dims import DIMENSIONS_RESOURCE, LlamaDims, dims_from_json

transformers = pytest.importorskip("transformers")

CONFIG = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=96, rope_theta=10000.0, eps=1e-5)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "Ġ t", "Ġt he", "4 2"]
USER_DEFINED = "<tool>"
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# How each GGUF tensor is stored: Q8_0 and F16 exercise dequantization, the rest is F32.
STORAGE = {"attn_q": gguf.GGMLQuantizationType.Q8_0, "attn_v": gguf.GGMLQuantizationType.F16}


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte value 0..255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


TOKENS = SPECIAL + byte_level_alphabet() + ["".join(m.split()) for m in MERGES] + [USER_DEFINED]
TOKEN_TYPES = ([gguf.TokenType.CONTROL] * len(SPECIAL) + [gguf.TokenType.NORMAL] * (256 + len(MERGES))
               + [gguf.TokenType.USER_DEFINED])
VOCAB = len(TOKENS)


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K row order: per head, the two rotate-half halves interleaved."""
    halves = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


def bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).float().numpy()


def decoded_as_stored(x: np.ndarray, qtype: gguf.GGMLQuantizationType | None) -> np.ndarray:
    """The values a GGUF reader gets back for `x` stored as `qtype` (row-wise, so it commutes with row permutation)."""
    if qtype is None:
        return x
    return gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype).reshape(x.shape)


def random_hf_weights(tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    c = CONFIG
    rng = np.random.default_rng(seed)
    q_width, kv_width = c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(c["hidden"])).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, c["hidden"])).astype(np.float32),
         "model.norm.weight": norm()}
    for i in range(c["layers"]):
        p = f"model.layers.{i}"
        w |= {
            f"{p}.input_layernorm.weight": norm(),
            f"{p}.self_attn.q_proj.weight": matrix(q_width, c["hidden"]) * 3,  # peakier attention
            f"{p}.self_attn.k_proj.weight": matrix(kv_width, c["hidden"]) * 3,
            f"{p}.self_attn.v_proj.weight": matrix(kv_width, c["hidden"]),
            f"{p}.self_attn.o_proj.weight": matrix(c["hidden"], q_width),
            f"{p}.post_attention_layernorm.weight": norm(),
            f"{p}.mlp.gate_proj.weight": matrix(c["intermediate"], c["hidden"]),
            f"{p}.mlp.up_proj.weight": matrix(c["intermediate"], c["hidden"]),
            f"{p}.mlp.down_proj.weight": matrix(c["hidden"], c["intermediate"]),
        }
    if not tied:
        w["lm_head.weight"] = matrix(VOCAB, c["hidden"])
    return w


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, i, *rest = hf_name.split(".")
    role = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
            "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}[".".join(rest[:-1])]
    return f"blk.{i}.{role}.weight"


def write_llama_gguf(path: Path, hf_weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Write `hf_weights` as llama.cpp would; returns the weights the artifact will hold (in HF names and layout)."""
    c = CONFIG
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(c["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(c["hidden"])
    writer.add_feed_forward_length(c["intermediate"])
    writer.add_head_count(c["heads"])
    writer.add_head_count_kv(c["kv_heads"])
    writer.add_rope_dimension_count(c["head_dim"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["eps"])
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([int(t) for t in TOKEN_TYPES])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    stored = {}
    for name, value in hf_weights.items():
        target = gguf_name(name)
        qtype = STORAGE.get(target.split(".")[-2])
        stored[name] = bf16(decoded_as_stored(value, qtype))
        if target.endswith("attn_q.weight"):
            value = llama_cpp_permute(value, c["heads"])
        elif target.endswith("attn_k.weight"):
            value = llama_cpp_permute(value, c["kv_heads"])
        if qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(target, value.astype(np.float16))
        elif qtype is not None:
            writer.add_tensor(target, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(target, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def hf_model(weights: dict[str, np.ndarray], tied: bool):
    c = CONFIG
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=c["hidden"], intermediate_size=c["intermediate"],
        num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
        head_dim=c["head_dim"], rms_norm_eps=c["eps"], rope_theta=c["rope_theta"], max_position_embeddings=256,
        tie_word_embeddings=tied, attention_bias=False, mlp_bias=False, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).eval()
    state = {name: torch.from_numpy(value) for name, value in weights.items()}
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model


@attrs.frozen
class TinyLlama:
    gguf: Path
    artifact: Path  # the bf16 conversion
    stored: dict[str, np.ndarray]  # the values the artifact holds, in HF names and layout
    tied: bool


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny(request, tmp_path_factory) -> TinyLlama:
    tied = request.param
    folder = tmp_path_factory.mktemp("tied" if tied else "untied")
    stored = write_llama_gguf(folder / "tiny.gguf", random_hf_weights(tied))
    convert(plan_gguf_llama(folder / "tiny.gguf"), folder / "tiny.ninfer", "bf16", progress=False)
    return TinyLlama(folder / "tiny.gguf", folder / "tiny.ninfer", stored, tied)


PROMPT = np.array([1, 70, 3, 200, 259, 12, 44, 44, 261, 5, 150, 90, 262, 17], dtype=np.int64)


def run_all(artifact: Path, ids: np.ndarray) -> np.ndarray:
    model = load_model(artifact)
    return model.forward(model.new_state(), ids, logits="all").logits


def test_logits_match_transformers_at_every_position(tiny):
    ours = run_all(tiny.artifact, PROMPT)
    with torch.no_grad():
        theirs = hf_model(tiny.stored, tiny.tied)(torch.from_numpy(PROMPT)[None]).logits[0].numpy()
    assert ours.shape == theirs.shape == (len(PROMPT), VOCAB)
    error = np.abs(ours - theirs).max()
    print(f"max abs logit error vs transformers ({'tied' if tiny.tied else 'untied'}): {error:.2e}")
    assert error < 1e-4 * max(1.0, np.abs(theirs).max())
    np.testing.assert_array_equal(ours.argmax(axis=-1), theirs.argmax(axis=-1))


def test_incremental_decode_equals_the_full_forward(tiny):
    full = run_all(tiny.artifact, PROMPT)
    model = load_model(tiny.artifact)
    state = model.new_state()
    steps = [model.forward(state, PROMPT[:5], logits="all").logits]
    for token in PROMPT[5:]:
        result = model.forward(state, np.array([token]))
        assert result.logits.shape == (1, VOCAB) and result.hidden.shape == (1, CONFIG["hidden"])
        steps.append(result.logits)
    assert state.position == len(PROMPT)
    # Same math, different matmul shapes: only fp32 rounding differs.
    tolerance = 1e-5 * max(1.0, np.abs(full).max())
    np.testing.assert_allclose(np.concatenate(steps), full, rtol=0, atol=tolerance)
    last = model.forward(model.new_state(), PROMPT).logits
    np.testing.assert_allclose(last, full[-1:], rtol=0, atol=tolerance)


def test_model_rejects_wrong_weights_and_empty_input(tiny):
    with Artifact.open(tiny.artifact) as a:
        dims = dims_from_json(a.resource(DIMENSIONS_RESOURCE))
        weights = {o.name: a.tensor(o.name).to_numpy() for o in a.objects if o.kind == "tensor"}
    model = LlamaModel(dims, DictWeights(weights))
    with pytest.raises(ValueError, match="at least one token"):
        model.forward(model.new_state(), np.array([], dtype=np.int64))
    with pytest.raises(ValueError, match="token ids must be in"):
        model.forward(model.new_state(), np.array([VOCAB]))
    weights["text/layers/1/mlp/down"] = weights["text/layers/1/mlp/down"].T
    with pytest.raises(ValueError, match=r"'text/layers/1/mlp/down' has shape \[96, 64\], expected \[64, 96\]"):
        LlamaModel(dims, DictWeights(weights))


def test_artifact_layout_and_dimensions(tiny):
    tied = tiny.tied
    with Artifact.open(tiny.artifact) as a:
        assert a.model_id == "llama-custom"
        names = [o.name for o in a.objects]
        assert names[:7] == ["frontend/tokenizer.json", "frontend/tokenizer_config.json",
                             "frontend/chat_template.jinja", "frontend/generation_config.json",
                             "frontend/preprocessor_config.json", "frontend/video_preprocessor_config.json",
                             DIMENSIONS_RESOURCE]
        assert names[7] == "text/token_embedding"
        assert ("text/output_head" in a) is not tied
        assert a.entry("text/layers/1/attention/query_key_value").shape == (64 + 2 * 32, 64)
        assert a.entry("text/layers/0/mlp/gate_up").shape == (2 * 96, 64)
        assert dims_from_json(a.resource(DIMENSIONS_RESOURCE)) == LlamaDims(
            hidden=64, layers=2, vocab_rows=VOCAB, vocab_ids=VOCAB, attn_heads=4, kv_heads=2, head_dim=16,
            intermediate=96, rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=tied)
        assert a.resource("frontend/chat_template.jinja").decode() == CHATML
        assert a.resource("frontend/preprocessor_config.json") == b"{}"
        assert a.resource("frontend/video_preprocessor_config.json") == b"{}"
        assert json.loads(a.resource("frontend/generation_config.json")) == {
            "bos_token_id": 1, "eos_token_id": [2], "pad_token_id": 0}
        config = json.loads(a.resource("frontend/tokenizer_config.json"))
        assert (config["bos_token"], config["eos_token"], config["pad_token"]) == tuple(SPECIAL[1:] + SPECIAL[:1])
        assert config["add_bos_token"] is False and config["chat_template"] == CHATML
        assert {int(i): t["special"] for i, t in config["added_tokens_decoder"].items()} == {0: True, 1: True, 2: True,
                                                                                            VOCAB - 1: False}


def test_tokenizer_splits_digits_like_llama_cpp_smollm(tiny):
    with Artifact.open(tiny.artifact) as a:
        tokenizer = Tokenizer.from_str(a.resource("frontend/tokenizer.json").decode())
    ids = {token: i for i, token in enumerate(TOKENS)}
    encoded = tokenizer.encode("<|im_start|>he the 42<tool>", add_special_tokens=False).ids
    # "42" is a merge, but smollm splits every digit before BPE (llama.cpp's "\p{N}" pre-split).
    assert encoded == [1, ids["he"], ids["Ġthe"], ids["Ġ"], ids["4"], ids["2"], VOCAB - 1]
    assert tokenizer.decode(encoded, skip_special_tokens=True) == "he the 42<tool>"


def test_ninfer_v2_recipe_uses_the_documented_formats(tiny, tmp_path):
    out = tmp_path / "v2.ninfer"
    report = convert(plan_gguf_llama(tiny.gguf), out, "ninfer-v2", progress=False)
    assert report["recipe_id"] == "llama_custom-v2"
    with Artifact.open(out) as a:
        formats = {o.name: o.format for o in a.objects if o.kind == "tensor"}
    assert formats["text/token_embedding"] == "W8G32_F16S"
    assert formats["text/layers/0/input_norm"] == formats["text/final_norm"] == "BF16"
    assert formats["text/layers/0/attention/query_key_value"] == formats["text/layers/1/mlp/gate_up"] == "W8G32_F16S"
    assert formats["text/layers/0/attention/output"] == formats["text/layers/1/mlp/down"] == "W8G32_F16S"
    assert formats.get("text/output_head") == (None if tiny.tied else "W8G32_F16S")
    logits = run_all(out, PROMPT)
    assert np.isfinite(logits).all()
    # 4-bit weights on a random model: close to the bf16 artifact, not equal.
    assert np.corrcoef(logits.ravel(), run_all(tiny.artifact, PROMPT).ravel())[0, 1] > 0.9


def test_undo_rope_permutation_inverts_llama_cpp():
    weight = np.arange(6 * 16 * 3, dtype=np.float32).reshape(6 * 16, 3)
    for heads in (1, 2, 6):
        np.testing.assert_array_equal(undo_rope_permutation(llama_cpp_permute(weight, heads), heads), weight)


def test_model_id_must_be_a_matching_llama_target(tiny):
    gguf_path = tiny.gguf
    assert plan_gguf_llama(gguf_path, model_id="llama-custom").model_id == "llama-custom"
    with pytest.raises(GGUFSourceError, match="not those of 'smollm2-135m-instruct'"):
        plan_gguf_llama(gguf_path, model_id="smollm2-135m-instruct")
    with pytest.raises(GGUFSourceError, match="is a qwen3_6 target"):
        plan_gguf_llama(gguf_path, model_id="qwen3.6-27b")
    with pytest.raises(GGUFSourceError, match="unknown model_id"):
        plan_gguf_llama(gguf_path, model_id="gpt-7")


def test_non_gguf_input_is_a_clear_error(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFSourceError, match="not a readable GGUF"):
        plan_gguf_llama(bogus)


def test_cli_converts_a_gguf(tiny, tmp_path, capsys):
    out = tmp_path / "cli.ninfer"
    assert main(["convert", str(tiny.gguf), "--out", str(out), "--recipe", "ninfer-v2", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert f"wrote {out}" in captured.out and "llama_custom-v2" in captured.out
    assert str(out) + ".conversion.json" in captured.out
    assert out.exists() and Path(str(out) + ".conversion.json").exists()


@pytest.mark.parametrize("args, message", [
    (["missing.gguf"], "not a checkpoint directory or a .gguf file"),
    (["{gguf}", "--model-id", "smollm2-135m-instruct"], "not those of"),
])
def test_cli_reports_errors_without_traceback(tiny, tmp_path, capsys, args, message):
    args = [a.replace("{gguf}", str(tiny.gguf)) for a in args]
    out = tmp_path / "x.ninfer"
    assert main(["convert", *args, "--out", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ninfer convert: error:") and message in err and "Traceback" not in err
    assert not out.exists()


def test_cli_sends_directories_to_the_checkpoint_planner(tmp_path, capsys):
    out = tmp_path / "x.ninfer"
    assert main(["convert", str(tmp_path), "--out", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ninfer convert: error:") and "config.json" in err and "Traceback" not in err
    assert not out.exists()
