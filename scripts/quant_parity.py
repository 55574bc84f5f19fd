"""quantization="gguf" against the dequantized path on real weights: per prompt, the greedy common prefix, the
teacher-forced argmax agreement and the worst relative logits error (one line each), plus weight memory.

usage: PYTHONPATH=$PWD python3 scripts/quant_parity.py MODEL [--device cuda] [--dtype auto] [--tokens 64]
       [--prompts 8] [--gguf-int8-gemv] [--gguf-gemv1] [--batch1]   (the reference: quantization="none" in --dtype; float32 on CPU, bf16 on
       CUDA; --gguf-int8-gemv: the gguf engine's one-row Q4_K / Q6_K layers on the integer-dot GEMV, which its
       greedy decode steps take; the teacher-forced logits come from prefill rows, which do not)
"""

from __future__ import annotations

import argparse
import time

import torch

PROMPTS = [
    "def fibonacci(n):",
    "# Write a quicksort in Python\n",
    "<|im_start|>user\nExplain what a hash map is in one paragraph.<|im_end|>\n<|im_start|>assistant\n",
    "SELECT name, COUNT(*) FROM users\n",
    "// C function that reverses a string in place\nvoid reverse(char *s) {",
    "Les nombres premiers inférieurs à 20 sont",
    "数据结构中的栈是",
    "class Matrix:\n    def __init__(self, rows, cols):\n        \t",
]


def logits_of(llm, seq: list[int]) -> torch.Tensor:
    from verispec.worker.inputs import SeqChunk, build_batch

    engine = llm.engine
    owned: list[int] = []
    assert engine.blocks.allocate(owned, len(seq))
    try:
        inp, pos, meta = build_batch([SeqChunk(seq, 0, owned)], engine.blocks.block_size, engine.runner.device)
        with torch.inference_mode():
            hidden, _ = engine.runner.model(inp, pos, meta, engine.runner.kv_caches)
            return engine.runner.model.compute_logits(hidden).float()
    finally:
        engine.blocks.free_blocks(owned)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--gguf-int8-gemv", action="store_true", help="KernelOptions.gguf_int8_gemv on the gguf engine")
    ap.add_argument("--gguf-gemv1", action="store_true",
                    help="KernelOptions.gguf_gemv1 on the gguf engine (one row of Q4_K on kernels/gguf_gemv.py)")
    ap.add_argument("--batch1", action="store_true",
                    help="the gguf engine generates one prompt at a time (one-row decode steps), the reference batched")
    a = ap.parse_args()
    from verispec import LLM, SamplingParams
    from verispec.models.layers.quant import step_weight_nbytes, weight_nbytes

    llms = {}
    for q in ("none", "gguf"):
        t0 = time.perf_counter()
        llms[q] = LLM(a.model, device=a.device, dtype=a.dtype, quantization=q, max_model_len=1024,
                      async_scheduling=False, enforce_eager=True)
        m = llms[q].engine.parts.model
        if q == "gguf" and (a.gguf_int8_gemv or a.gguf_gemv1):  # eager engines: no graph captured with the old options
            import dataclasses

            from verispec.models.kernel_path import enable_triton, kernels_on, options_of

            if not kernels_on(m):
                raise SystemExit("--gguf-int8-gemv / --gguf-gemv1 need the CUDA path (the GGUF kernels)")
            enable_triton(m, options=dataclasses.replace(options_of(m), gguf_int8_gemv=a.gguf_int8_gemv,
                                                         gguf_gemv1=a.gguf_gemv1))
        print(f"{q}: loaded in {time.perf_counter() - t0:.1f}s, weights {weight_nbytes(m) / 1e6:.0f} MB, "
              f"{step_weight_nbytes(m) / 1e6:.0f} MB read per decode step", flush=True)
    ref, q = llms["none"], llms["gguf"]
    ids = [ref.tokenizer.encode(p) for p in PROMPTS[: a.prompts]]
    sp = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    r = [o.outputs[0].token_ids for o in ref.generate(prompt_token_ids=ids, sampling_params=sp, use_tqdm=False)]
    if a.batch1:  # one prompt at a time: every decode step has one row (the CPU's int8 GEMV, the CUDA one-row path)
        g = [q.generate(prompt_token_ids=[p], sampling_params=sp, use_tqdm=False)[0].outputs[0].token_ids for p in ids]
    else:
        g = [o.outputs[0].token_ids for o in q.generate(prompt_token_ids=ids, sampling_params=sp, use_tqdm=False)]
    tfs, rels = [], []
    for i, (x, y) in enumerate(zip(r, g, strict=True)):
        prefix = next((j for j, (u, v) in enumerate(zip(x, y, strict=True)) if u != v), a.tokens)
        seq = ids[i] + x
        lr, lq = logits_of(ref, seq)[len(ids[i]) - 1 : -1], logits_of(q, seq)[len(ids[i]) - 1 : -1]
        tf = float((lq.argmax(-1).cpu() == torch.tensor(x)).float().mean())
        rel = float(((lq - lr).norm(dim=-1) / lr.norm(dim=-1)).max())
        tfs.append(tf)
        rels.append(rel)
        print(f"prompt {i}: greedy common prefix {prefix}/{a.tokens}, teacher-forced agreement {tf:.3f}, "
              f"worst rel logits err {rel:.4f}", flush=True)
    print(f"mean teacher-forced agreement {sum(tfs) / len(tfs):.3f}, worst rel logits err {max(rels):.4f}")


if __name__ == "__main__":
    main()
