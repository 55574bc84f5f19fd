"""A tiny random Llama written to GGUF the way llama.cpp's convert_hf_to_gguf.py writes one.

No Llama GGUF can be downloaded here, so tests make one: a transformers `LlamaForCausalLM` (float32, random
weights scaled so that activations are O(1)), a byte-level BPE tokenizer trained on a few lines of text
(the "gpt2" tokenizer model with the "llama-bpe" pre-tokenizer, as Llama 3 GGUFs have), and the GGUF file:
tensor names from the `gguf` package's own HF -> GGUF name map, q/k rows permuted as the convert script's
`LlamaModel.permute` does, F32 or F16 (1-D tensors stay F32, as with `--outtype f16`), or Q8_0 / Q5_0
quantized by the `gguf` package's own quantizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs.",
    "for i in range(10):\n    print(i, i * i)\n",
    "import numpy as np\nx = np.zeros((3, 4))\n",
]


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # Llama 3.1's


def tiny_llama(vocab_size: int, seed: int = 0, layers: int = 2, tie: bool = False, rope_scaling: dict | None = None,
               rope_theta: float = 10000.0):
    """A random LlamaForCausalLM in float32 and eval mode: GQA (4 heads, 2 KV heads), head_dim 16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta}
    positions = 4 * rope.get("original_max_position_embeddings", 64)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=positions,
                      rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=tie, attention_bias=False,
                      mlp_bias=False, bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # q/k at twice the fan-in scale: attention scores well away from uniform
                scale = 2.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return model


def train_tokenizer(vocab_size: int) -> tuple[list[str], list[str], list[int]]:
    """(tokens by id, merges as "a b", GGUF token types): byte-level BPE on CORPUS, then BOS and EOS."""
    from tokenizers import ByteLevelBPETokenizer

    t = ByteLevelBPETokenizer()
    t.train_from_iterator(CORPUS, vocab_size=vocab_size - 2, min_frequency=1, show_progress=False)
    vocab = t.get_vocab()
    assert sorted(vocab.values()) == list(range(vocab_size - 2)), "the BPE vocabulary came out short"
    tokens = sorted(vocab, key=vocab.get) + [BOS, EOS]
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(t.to_str())["model"]["merges"]]
    types = [1] * (vocab_size - 2) + [3, 3]  # NORMAL, then CONTROL for BOS / EOS
    return tokens, merges, types


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_theta(config) -> float:
    """A transformers config's rope base (in rope_parameters since transformers 5)."""
    return float(_rope_params(config).get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _rope_params(config) -> dict:
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


def llama3_rope_factors(config) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel rope_freqs for rope_type "llama3" (one factor per frequency)."""
    import math

    p = _rope_params(config)
    base, dim = rope_theta(config), config.head_dim
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = p.get("factor", 8.0), p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old_context_len = p.get("original_max_position_embeddings", 8192)
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_llama_gguf(model, path: Path, outtype: str = "f32") -> None:
    """`model` (a LlamaForCausalLM) and train_tokenizer's tokenizer as a llama.cpp-layout GGUF file."""
    import gguf

    c = model.config
    tokens, merges, types = train_tokenizer(c.vocab_size)
    arch = gguf.MODEL_ARCH.LLAMA
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name("tiny-llama")
    w.add_vocab_size(c.vocab_size)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_rope_dimension_count(c.head_dim)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(rope_theta(c))
    quant = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q5_0": gguf.GGMLQuantizationType.Q5_0}.get(outtype)
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0}[outtype])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_add_bos_token(False)
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    if _rope_params(c).get("rope_type") == "llama3":  # the converter's extra tensor: per-frequency factors
        w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", llama3_rope_factors(c))
    for name, t in model.state_dict().items():
        if c.tie_word_embeddings and name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output.weight
        data = t.detach().float().numpy()
        if name.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, c.num_attention_heads, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, c.num_attention_heads, c.num_key_value_heads)
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        if outtype == "f16" and data.ndim > 1:
            data = data.astype(np.float16)
        if quant is not None and data.ndim > 1:  # gguf's own quantizer, as llama-quantize would write them
            w.add_tensor(new, gguf.quants.quantize(np.ascontiguousarray(data), quant), raw_dtype=quant)
            continue
        w.add_tensor(new, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
