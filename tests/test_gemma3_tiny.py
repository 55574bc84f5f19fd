"""A tiny random Gemma 3 in verispec against transformers' Gemma3ForCausalLM with the same weights
(CPU float32): logits at every position of prefill, verify and decode steps, with a window of 5 so
local layers really cut keys, a query scalar unlike head_dim and final-logit softcapping on; and the
model with the Triton attention backend (the interpreter on CPU) against its torch path. Fast: no file."""

from __future__ import annotations

import pytest
import torch

from verispec.config import ModelConfig
from verispec.models.build import build_model
from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch

WINDOW, LAYERS, PATTERN, VOCAB = 5, 5, 3, 300


@pytest.fixture(scope="module")
def pair():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    layer_types = ["full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention" for i in range(LAYERS)]
    hc = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        query_pre_attn_scalar=24, sliding_window=WINDOW, layer_types=layer_types, final_logit_softcapping=3.0,
        tie_word_embeddings=True, attn_implementation="eager")
    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(hc).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))  # Gemma's norms scale by 1 + w
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5 * (3.0 if "embed" in name else 1.5))
    cfg = ModelConfig.for_arch(
        "gemma3", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=LAYERS, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=1_000_000.0, max_position_embeddings=256, sliding_window=WINDOW,
        sliding_window_pattern=PATTERN, query_pre_attn_scalar=24, final_logit_softcapping=3.0)
    # Hugging Face holds w, verispec (like the GGUF) 1 + w.
    sd = {k: (v + 1 if k.endswith("norm.weight") else v).clone() for k, v in hf.state_dict().items()
          if k != "lm_head.weight"}
    return hf, build_model(cfg, sd, torch.device("cpu"), torch.float32)


SEQ = [(7 * i + 3) % VOCAB for i in range(37)]


def ours(model) -> torch.Tensor:
    """Logits of SEQ: a 30-token prefill, a 5-token verify step, two decode steps (one paged cache)."""
    c = model.config
    kv = allocate_kv_cache(c.num_layers, 4, 16, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    blocks, out = [2, 0, 3], []
    for start, end in ((0, 30), (30, 35), (35, 36), (36, 37)):
        ids, pos, meta = build_batch([SeqChunk(SEQ[start:end], start, blocks)], 16, torch.device("cpu"))
        with torch.inference_mode():
            hidden, _ = model(ids, pos, meta, kv)
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


def test_logits_match_transformers(pair):
    hf, model = pair
    with torch.no_grad():
        ref = hf(torch.tensor([SEQ])).logits[0].float()
    got = ours(model)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert float(ref.abs().max()) <= 3.0  # softcapped (and the cap is reached: tanh saturates near it)
    assert float(ref.abs().max()) > 1.0


def test_window_matters_here(pair):
    """Widening our local layers' window changes the logits past position WINDOW: the test above sees it."""
    _, model = pair
    base = ours(model)
    local = [layer.self_attn for layer in model.model.layers if layer.self_attn.window]
    assert len(local) == LAYERS - LAYERS // PATTERN
    for a in local:
        a.window = 0
    try:
        wide = ours(model)
    finally:
        for a in local:
            a.window = WINDOW
    torch.testing.assert_close(wide[:WINDOW], base[:WINDOW])
    assert float((wide[WINDOW:] - base[WINDOW:]).abs().max()) > 1e-2


def test_triton_backend_matches_reference(pair):
    from verispec.models.kernel_path import enable_triton

    _, model = pair
    base = ours(model)
    enable_triton(model, True)
    try:
        got = ours(model)
    finally:
        enable_triton(model, False)
    torch.testing.assert_close(got, base, atol=1e-4, rtol=1e-4)
