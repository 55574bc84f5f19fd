"""Weight loading: GGUF parsing, config, HF names, cache and error reporting (a Llama GGUF against
transformers: tests/test_llama_gguf.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as ref_dequantize
from llama_gguf import llama_cpp_permute
from safetensors.torch import save_file

import verispec.loader.weights as W
from verispec.loader.gguf import GGUFError, GGUFFile, read_metadata, read_model_config
from verispec.loader.weights import cache_path, load_weights


def _expected_shapes(cfg) -> dict[str, tuple[int, ...]]:
    h, q, kv, ff = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h), p + "mlp.down_proj.weight": (h, ff),
        }
        if cfg.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,)}
    return shapes


@pytest.fixture(scope="module")
def loaded_05b(qwen05_path, tmp_path_factory):
    """The 0.5B loaded twice (fresh, then from the cache) in bfloat16, with a private cache dir."""
    cache = tmp_path_factory.mktemp("vcache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERISPEC_CACHE_DIR", str(cache))
        cfg, sd = load_weights(qwen05_path, device="cpu", dtype=torch.bfloat16)
        entry = cache_path(qwen05_path, torch.bfloat16)
        assert entry.is_file() and entry.is_relative_to(cache)

        def no_dequant(*a, **k):
            raise AssertionError("the second load must come from the cache")

        mp.setattr(W, "_dequantize_gguf", no_dequant)
        cfg2, sd2 = load_weights(qwen05_path, device="cpu", dtype=torch.bfloat16)
    yield cfg, sd, cfg2, sd2


def test_real_config_and_shapes(loaded_05b, qwen05_path) -> None:
    cfg, sd, _, _ = loaded_05b
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("qwen2", 24, 896, 14, 2)
    assert (cfg.head_dim, cfg.vocab_size, cfg.intermediate_size) == (64, 151936, 4864)
    assert cfg.qkv_bias and not cfg.qk_norm and cfg.rope_theta == 1e6 and cfg.rms_norm_eps == 1e-6
    assert (cfg.bos_token_id, cfg.eos_token_id) == (151643, 151645)
    # this file ships its own (Q8_0) output.weight, so it is loaded untied as lm_head
    has_output = "output.weight" in GGUFFile(qwen05_path).tensors
    assert cfg.tie_word_embeddings == (not has_output)
    assert cfg == read_model_config(qwen05_path)
    shapes = _expected_shapes(cfg)
    assert set(sd) == set(shapes)
    for k, v in sd.items():
        assert tuple(v.shape) == shapes[k], k
        assert v.dtype == torch.bfloat16 and v.device.type == "cpu"


def test_real_tensors_match_reference(loaded_05b, qwen05_path) -> None:
    _, sd, _, _ = loaded_05b
    f = GGUFFile(qwen05_path)
    pairs = {"blk.3.attn_q.weight": "model.layers.3.self_attn.q_proj.weight",
             "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
             "blk.5.attn_k.bias": "model.layers.5.self_attn.k_proj.bias",
             "output_norm.weight": "model.norm.weight"}
    for gname, hname in pairs.items():
        info = f.tensors[gname]
        rows = info.shape[0] if len(info.shape) > 1 else 1
        want = ref_dequantize(f.raw(gname).numpy().reshape(rows, -1), GGMLQuantizationType(info.ggml_type))
        assert torch.equal(sd[hname], torch.from_numpy(want).reshape(info.shape).to(torch.bfloat16)), gname


def test_cache_round_trip(loaded_05b) -> None:
    cfg, sd, cfg2, sd2 = loaded_05b
    assert cfg2 == cfg and set(sd2) == set(sd)
    assert all(sd2[k].dtype == sd[k].dtype and torch.equal(sd2[k], sd[k]) for k in sd)


def test_read_metadata_plain_values(qwen05_path) -> None:
    meta = read_metadata(qwen05_path)
    tokens, merges = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"]
    assert isinstance(tokens, list) and len(tokens) == 151936 and all(isinstance(t, str) for t in tokens[:100])
    assert isinstance(merges, list) and isinstance(merges[0], str) and " " in merges[0]
    assert isinstance(meta["tokenizer.ggml.token_type"][0], int)
    assert isinstance(meta["tokenizer.chat_template"], str) and "<|im_start|>" in meta["tokenizer.chat_template"]
    assert meta["tokenizer.ggml.add_bos_token"] is False and meta["tokenizer.ggml.eos_token_id"] == 151645


def _prefix_copy(src: Path, dst: Path, n: int, patch: bytes = b"") -> Path:
    with open(src, "rb") as fh:
        data = fh.read(n)
    dst.write_bytes(patch + data[len(patch):])
    return dst


@pytest.mark.parametrize("where", ["header", "tokens", "tensor_data"])
def test_truncated_file(qwen05_path, tmp_path, where) -> None:
    data_start = GGUFFile(qwen05_path).data_offset
    cut = {"header": 20, "tokens": data_start // 3, "tensor_data": data_start + (1 << 20)}[where]
    bad = _prefix_copy(qwen05_path, tmp_path / f"cut-{where}.gguf", cut)
    with pytest.raises(GGUFError, match="truncated") as e:
        load_weights(bad, use_cache=False)
    assert str(bad) in str(e.value)


def test_bad_magic_and_version(qwen05_path, tmp_path) -> None:
    bad = _prefix_copy(qwen05_path, tmp_path / "magic.gguf", 1 << 16, patch=b"GGUX")
    with pytest.raises(GGUFError, match="magic") as e:
        read_metadata(bad)
    assert str(bad) in str(e.value)
    ver = _prefix_copy(qwen05_path, tmp_path / "ver.gguf", 1 << 16, patch=b"GGUF\x07\x00\x00\x00")
    with pytest.raises(GGUFError, match="version 7") as e:
        read_metadata(ver)
    assert str(ver) in str(e.value)


def _write_tiny_gguf(path: Path, hf: dict[str, np.ndarray], arch: str = "llama", drop: str = "",
                     extra: dict | None = None) -> None:
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(16)
    if drop != "feed_forward_length":
        w.add_feed_forward_length(24)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_token_list([f"t{i}" for i in range(32)])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    names |= {f"model.layers.0.{h}": f"blk.0.{g}" for g, h in [
        ("attn_norm.weight", "input_layernorm.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight"),
        ("attn_q.weight", "self_attn.q_proj.weight"), ("attn_k.weight", "self_attn.k_proj.weight"),
        ("attn_v.weight", "self_attn.v_proj.weight"), ("attn_output.weight", "self_attn.o_proj.weight"),
        ("ffn_gate.weight", "mlp.gate_proj.weight"), ("ffn_up.weight", "mlp.up_proj.weight"),
        ("ffn_down.weight", "mlp.down_proj.weight")]}
    for hname, arr in hf.items():
        if drop and names[hname].endswith(drop):
            continue
        if hname.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, 4, 4)
        elif hname.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, 4, 2)
        w.add_tensor(names[hname], arr)
    for name, (arr, qtype) in (extra or {}).items():
        w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny_hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (32, 16), "model.norm.weight": (16,),
              "model.layers.0.input_layernorm.weight": (16,), "model.layers.0.post_attention_layernorm.weight": (16,),
              "model.layers.0.self_attn.q_proj.weight": (16, 16), "model.layers.0.self_attn.k_proj.weight": (8, 16),
              "model.layers.0.self_attn.v_proj.weight": (8, 16), "model.layers.0.self_attn.o_proj.weight": (16, 16),
              "model.layers.0.mlp.gate_proj.weight": (24, 16), "model.layers.0.mlp.up_proj.weight": (24, 16),
              "model.layers.0.mlp.down_proj.weight": (16, 24)}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def test_tiny_llama_gguf_config(tmp_path, monkeypatch) -> None:
    """The config read from a llama file and use_cache=False (the logits: tests/test_llama_gguf.py)."""
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache"))
    hf = _tiny_hf_weights()
    path = tmp_path / "tiny-llama.gguf"
    _write_tiny_gguf(path, hf)
    cfg, sd = load_weights(path, use_cache=False)
    assert (cfg.arch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == ("llama", 4, 2, 4, 32)
    assert cfg.tie_word_embeddings and not cfg.qkv_bias and cfg.rms_norm_eps == 1e-5
    assert set(sd) == set(hf)
    assert not (tmp_path / "cache").exists()  # use_cache=False writes nothing


def test_missing_metadata_and_tensor_and_unsupported_type(tmp_path) -> None:
    hf = _tiny_hf_weights()
    no_up = tmp_path / "no-up.gguf"
    _write_tiny_gguf(no_up, hf, drop="ffn_up.weight")
    with pytest.raises(GGUFError, match="missing tensor") as e:
        load_weights(no_up, use_cache=False)
    assert str(no_up) in str(e.value) and "up_proj" in str(e.value)
    no_ff = tmp_path / "no-ff.gguf"
    _write_tiny_gguf(no_ff, hf, drop="feed_forward_length")
    with pytest.raises(GGUFError, match="missing required metadata key 'llama.feed_forward_length'") as e:
        load_weights(no_ff, use_cache=False)
    assert str(no_ff) in str(e.value)
    bad_arch = tmp_path / "gpt2.gguf"
    w = GGUFWriter(str(bad_arch), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="unsupported architecture 'gpt2'") as e:
        read_model_config(bad_arch)
    assert str(bad_arch) in str(e.value)
    iq = tmp_path / "iq.gguf"
    blob = np.zeros((1, 66), dtype=np.uint8)  # one IQ2_XXS block
    _write_tiny_gguf(iq, hf, extra={"blk.0.ffn_up.weight": (blob, GGMLQuantizationType.IQ2_XXS)}, drop="ffn_up.weight")
    with pytest.raises(GGUFError, match="IQ2_XXS") as e:
        load_weights(iq, use_cache=False)
    assert str(iq) in str(e.value)


def test_hf_folder(tmp_path) -> None:
    hf = {k: torch.from_numpy(v) for k, v in _tiny_hf_weights(1).items()}
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"].clone()
    hf |= {f"model.layers.0.self_attn.{p}_norm.weight": torch.ones(4) for p in "qk"}
    folder = tmp_path / "tiny-qwen3"
    folder.mkdir()
    save_file(hf, str(folder / "model.safetensors"))
    cfg_json = {"model_type": "qwen3", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
                "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
                "rope_theta": 5e5, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "eos_token_id": [7, 8]}
    (folder / "config.json").write_text(json.dumps(cfg_json))
    cfg, sd = load_weights(folder, dtype=torch.bfloat16)
    assert (cfg.arch, cfg.qk_norm, cfg.qkv_bias, cfg.tie_word_embeddings) == ("qwen3", True, False, True)
    assert (cfg.rope_theta, cfg.eos_token_id, cfg.head_dim) == (5e5, 7, 4)
    assert "lm_head.weight" not in sd and set(sd) == set(hf) - {"lm_head.weight"}
    assert torch.equal(sd["model.layers.0.mlp.up_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"].bfloat16())
    os.remove(folder / "model.safetensors")
    save_file({k: v for k, v in hf.items() if "down_proj" not in k}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj"):
        load_weights(folder)
