"""Peers: Hugging Face transformers in the same process on verispec's own weights, and published figures.

The HF model is built from a transformers config made from verispec's (`Qwen2Config` for Qwen2,
`Gemma3TextConfig` for Gemma 3) and verispec's state dict (verispec uses Hugging Face's parameter names),
sharing the tensors: no second GGUF dequantization (no `gguf` package needed), identical weights. Gemma 3's
norms are the one exception: verispec holds 1 + w (as the GGUF stores them), transformers w, so those small
vectors are copies with the 1 taken off.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable

import torch

from verispec.bench.drive import sync
from verispec.models.qwen2 import CausalLM

# Figures measured on the H200 (shared/device/README.md, 2026-11-30), for printing next to ours.
PUBLISHED: dict[str, dict[str, float]] = {
    "hf_1.5b_batch1_tok_s": {"eager": 42.6, "static+compile": 241.8, "assisted(0.5b)": 23.5, "prompt_lookup": 52.2},
    "llamacpp_1.5b_bf16_tok_s": {"batch1": 442.0, "draft_0.5b_k4_q4": 339.0},
    # llama.cpp batched generation, 1.5B BF16, 128 prompt + 256 output tokens, by number of sequences.
    "llamacpp_1.5b_bf16_batched_tok_s": {"1": 412.0, "16": 3810.0, "64": 13697.0, "256": 22592.0},
    "plain_pytorch_cuda_graph_1.5b_tok_s": {"batch1": 296.0},
    "physical_limit_1.5b_tok_s": {"batch1": 1300.0},
}


HF_ARCHS = ("qwen2", "gemma3")  # the architectures hf_model builds


def _qwen2_config(c):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings, rope_theta=c.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
    )


def _gemma3_config(c):
    """Gemma3TextConfig from verispec's config: the same local / global layer pattern, both rotary bases,
    the query scalar and softcapping (transformers' default activation is Gemma's gelu-tanh)."""
    from transformers import Gemma3TextConfig

    layer_types = ["sliding_attention" if w else "full_attention" for w in c.layer_windows()]
    scalar = c.query_pre_attn_scalar or c.head_dim
    scalar = int(scalar) if float(scalar).is_integer() else scalar  # transformers' strict config types it int
    return Gemma3TextConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
                         "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta}},
        query_pre_attn_scalar=scalar, sliding_window=c.sliding_window,
        layer_types=layer_types, final_logit_softcapping=c.final_logit_softcapping, attn_logit_softcapping=None,
        tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
    )


def hf_model(model: CausalLM):
    """A transformers causal LM (Qwen2ForCausalLM or Gemma3ForCausalLM) sharing `model`'s weights (same
    device and dtype), in eval mode. ValueError for another architecture or quantized weights."""
    c = model.config
    if c.arch not in HF_ARCHS:
        raise ValueError(f"the HF peer builds {', '.join(HF_ARCHS)} models, not {c.arch!r}")
    from verispec.models.layers.quant import is_quantized

    if any(is_quantized(m) for m in model.modules()):
        raise ValueError("the HF peer shares dense weights: run it with --quantization none")
    from transformers import GenerationConfig

    params = model.hf_state_dict()
    if c.arch == "gemma3":
        from transformers import Gemma3ForCausalLM as cls

        hf_cfg = _gemma3_config(c)
        params = {n: (t - 1 if n.endswith("norm.weight") else t) for n, t in params.items()}
    else:
        from transformers import Qwen2ForCausalLM as cls

        hf_cfg = _qwen2_config(c)
    weight = params["model.embed_tokens.weight"]
    old = torch.get_default_dtype()
    torch.set_default_dtype(weight.dtype)
    try:
        with torch.device(weight.device):
            hf = cls(hf_cfg)
    finally:
        torch.set_default_dtype(old)
    missing, unexpected = hf.load_state_dict(params, strict=False, assign=True)
    missing = [m for m in missing if not (c.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"HF peer: state dict mismatch, missing {missing[:3]}, unexpected {unexpected[:3]}")
    if c.tie_word_embeddings:
        hf.tie_weights()
    # No EOS: generation runs to max_new_tokens, like verispec's ignore_eos.
    hf.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, bos_token_id=None)
    return hf.eval()


def _generate(hf, batch: list[list[int]], max_new: int, **kw) -> tuple[list[list[int]], float]:
    """Greedy generate for equal-length prompts; (new tokens per prompt, seconds, GPU synchronized)."""
    dev = hf.model.embed_tokens.weight.device
    inp = torch.tensor(batch, device=dev)
    sync(dev)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new, min_new_tokens=0,
                          do_sample=False, **kw)
    sync(dev)
    secs = time.perf_counter() - t0
    return out[:, inp.shape[1]:].tolist(), secs


def _guarded(name: str, fn: Callable[[], dict]) -> dict:
    """Run one peer; a failure becomes {"peer": name, "error": ...} instead of ending the bench."""
    try:
        return {"peer": name, **fn()}
    except Exception as e:  # a peer failing (e.g. torch.compile) must not end the bench
        traceback.print_exc()
        return {"peer": name, "error": f"{type(e).__name__}: {e}"[:500]}


class _Compiled:
    """`model.forward` replaced by torch.compile(mode="reduce-overhead", fullgraph=True) while inside."""

    def __init__(self, hf) -> None:
        self.hf = hf

    def __enter__(self):
        self.hf.forward = torch.compile(self.hf.forward, mode="reduce-overhead", fullgraph=True)
        return self.hf

    def __exit__(self, *exc) -> None:
        del self.hf.forward  # back to the class's forward


def hf_modes(compile_: bool) -> list[str]:
    """The HF generate modes a bench runs: eager, and static cache + torch.compile unless disabled."""
    return ["hf eager"] + (["hf static+compile"] if compile_ else [])


def _mode_kwargs(mode: str) -> dict:
    return {"cache_implementation": "static"} if mode == "hf static+compile" else {}


def hf_latency(hf, batch: list[list[int]], output_len: int, mode: str, warmup: int = 1) -> dict:
    """TTFT (a 1-token generate), time per output token and decode tok/s of one HF mode on an equal-length batch."""

    def run() -> dict:
        kw = _mode_kwargs(mode)
        for _ in range(warmup + (2 if kw else 0)):  # a compiled forward needs extra runs to settle
            _generate(hf, batch, output_len, **kw)
        toks, total = _generate(hf, batch, output_len, **kw)
        _, ttft = _generate(hf, batch, 1, **kw)
        decode = max(total - ttft, 1e-9)
        n = len(batch) * (output_len - 1)
        return {"ttft_s": ttft, "tpot_s": decode / max(output_len - 1, 1), "decode_tok_s": n / decode,
                "total_s": total, "output_tok_s": len(batch) * output_len / total, "output_tokens": len(batch) * output_len, "outputs": toks}

    if mode == "hf static+compile":
        with _Compiled(hf):
            return _guarded(mode, run)
    return _guarded(mode, run)


def hf_sequential(hf, prompts: list[list[int]], max_new: int, mode: str, k: int = 4,
                  assistant=None, warmup: int = 1) -> dict:
    """Batch-1 generation over `prompts` one after another: tok/s and the tokens (for the identity check).

    Modes: "hf eager", "hf static+compile", "hf assisted" (needs `assistant`), "hf prompt lookup" (k tokens)."""
    kw: dict = _mode_kwargs(mode)
    if mode == "hf assisted":
        kw["assistant_model"] = assistant
    elif mode == "hf prompt lookup":
        kw["prompt_lookup_num_tokens"] = k

    def run() -> dict:
        if mode == "hf static+compile":
            # The longest prompt, full length: the static cache sized for it is reused by every later call,
            # and the compiled decode graph is recorded for that cache shape.
            for _ in range(warmup + 2):
                _generate(hf, [max(prompts, key=len)], max_new, **kw)
        for p in prompts[:warmup]:
            _generate(hf, [p], min(max_new, 16), **kw)
        outs, secs = [], 0.0
        for p in prompts:
            toks, dt = _generate(hf, [p], max_new, **kw)
            outs.append(toks[0])
            secs += dt
        n = sum(len(o) for o in outs)
        return {"tok_s": n / secs, "total_s": secs, "output_tokens": n, "outputs": outs}

    if mode == "hf static+compile":
        with _Compiled(hf):
            return _guarded(mode, run)
    return _guarded(mode, run)
