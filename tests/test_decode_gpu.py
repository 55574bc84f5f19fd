"""The batch-1 decode kernels on a real model (H200): one-row GEMV, qkv + rotary + KV write, the
norm prologues and PDL, against the same model's torch path (F.linear, torch attention)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _decode_logits(model, prompt: list[int], steps: int, triton_on: bool) -> list[torch.Tensor]:
    """Prefill `prompt`, then `steps` one-token greedy decode steps (each a one-row forward); the
    logits of every step. Triton on: the engine's CUDA kernels; off: plain torch on the GPU."""
    from verispec.models.kernel_path import enable_triton
    from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch

    cfg, dev = model.config, torch.device("cuda")
    enable_triton(model, triton_on)
    kv = allocate_kv_cache(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, dev)
    table = list(range(8))
    ids, pos, meta = build_batch([SeqChunk(prompt, 0, table)], 16, dev, with_reference=not triton_on)
    hidden, _ = model(ids, pos, meta, kv)
    token = int(model.compute_logits(hidden[-1:]).argmax())
    out = []
    for i in range(steps):
        ids, pos, meta = build_batch([SeqChunk([token], len(prompt) + i, table)], 16, dev,
                                     with_reference=not triton_on)
        logits = model.compute_logits(model(ids, pos, meta, kv)[0])[0]
        out.append(logits)
        token = int(logits.argmax())
    enable_triton(model, False)
    return out


def test_real_model_one_row_decode_matches_torch_path():
    """Both paths decode their own greedy tokens from the real 0.5B; every step's logits agree
    within bf16 rounding, with the same argmax wherever the top two are clearly apart (until the
    paths pick different tokens, if ever)."""
    from verispec.loader.model_loader import load_model

    tok, _, model = load_model("qwen2.5-coder-0.5b-instruct", torch.device("cuda"), torch.bfloat16, progress=False)
    prompt = tok.encode("def fibonacci(n):\n    ")
    fast = _decode_logits(model, prompt, 24, True)
    ref = _decode_logits(model, prompt, 24, False)
    for step, (a, b) in enumerate(zip(fast, ref, strict=True)):
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < 3e-2, f"step {step}: relative logit error {rel:.3g}"
        top2 = b.topk(2).values
        if (top2[0] - top2[1]).item() > 0.5:
            assert a.argmax() == b.argmax(), f"step {step}: argmax differs at a clear margin"
        if a.argmax() != b.argmax():
            break  # the two paths now decode different tokens; later steps are not comparable
