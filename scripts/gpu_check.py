"""GPU check of the Triton kernels and CUDA graphs (run on the H200: python scripts/gpu_check.py).

(a) tests/test_kernels.py -m gpu (bf16 kernels vs the torch references) plus long-context checks;
(b) a random-weight model with Qwen2.5-1.5B's shapes: CUDA-graph replay vs eager for batch 1/3/16,
    decode and verify, with new seq_lens / block tables / tokens every replay;
(c) batch-1 decode timing: eager reference, eager Triton, graph + Triton (and a few more rows).
Prints a table at the end; exits non-zero when a check fails. Takes about 2-3 minutes.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from verispec.attention.reference import ReferenceBackend, reference_attention  # noqa: E402
from verispec.config import ModelConfig  # noqa: E402
from verispec.kernels import paged_attention as pa  # noqa: E402
from verispec.models.kernel_path import enable_triton  # noqa: E402
from verispec.models.qwen2 import CausalLM, build_model  # noqa: E402
from verispec.worker.graphs import CudaGraphRunner  # noqa: E402
from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch  # noqa: E402

DEV = torch.device("cuda")
BS = 16
NUM_BLOCKS = 4096  # the last one is the graphs' scratch block
K = 4  # verify steps have 1 + K queries
HBM = 4.3e12
failures: list[str] = []
rows: list[tuple] = []


def check(ok: bool, what: str) -> None:
    print(("  ok   " if ok else "  FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def kernel_checks() -> None:
    print("== (a) kernel tests on CUDA", flush=True)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_kernels.py"], cwd=ROOT)
    check(r.returncode == 0, f"pytest tests/test_kernels.py -m gpu ({time.perf_counter() - t:.0f}s)")
    rng = random.Random(0)
    for heads, kvh, hd in ((12, 2, 128), (14, 2, 64)):
        for shapes in ([(1, 4001)], [(1, rng.randint(1, 3000)) for _ in range(37)], [(5, 2999), (5, 17), (5, 1203)]):
            chunks, perm = [], list(range(NUM_BLOCKS))
            rng.shuffle(perm)
            for ql, sl in shapes:
                chunks.append(SeqChunk([0] * ql, sl - ql, [perm.pop() for _ in range(-(-sl // BS))]))
            _, _, meta = build_batch(chunks, BS, DEV)
            kv = torch.randn(2, NUM_BLOCKS * BS, kvh, hd, device=DEV, dtype=torch.bfloat16)
            q = torch.randn(meta.slot_mapping.shape[0], heads, hd, device=DEV, dtype=torch.bfloat16)
            ref = reference_attention(q.float(), kv.float(), meta, hd**-0.5)
            for s in (1, None):
                out = torch.full_like(q, float("nan"))
                pa.triton_attention(q, kv, meta, hd**-0.5, num_splits=s, out=out)
                err = (out.float() - ref).abs().max().item()
                check(err < 2e-2, f"attention H{heads}/KH{kvh}/D{hd} B={len(shapes)} q={shapes[0][0]} "
                      f"max_ctx={max(x[1] for x in shapes)} splits={s}: max err {err:.2e}")


def random_model() -> CausalLM:
    cfg = ModelConfig.for_arch(
        "qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
        num_kv_heads=2, head_dim=128, tie_word_embeddings=True,
    )
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in CausalLM(cfg).named_parameters()}
    g = torch.Generator(device=DEV).manual_seed(0)
    sd = {}
    for n, shape in shapes.items():
        x = torch.randn(shape, generator=g, device=DEV, dtype=torch.bfloat16)
        sd[n] = 1 + 0.1 * x if n.endswith("norm.weight") else x * 0.02
    return build_model(cfg, sd, DEV, torch.bfloat16)


def random_step(n: int, q: int, rng: random.Random, vocab: int, max_ctx: int = 1500):
    """n sequences with q new tokens each, random context lengths and block tables."""
    perm = list(range(NUM_BLOCKS - 1))  # never the scratch block
    rng.shuffle(perm)
    chunks = []
    for _ in range(n):
        sl = rng.randint(q, max_ctx)
        chunks.append(SeqChunk([rng.randrange(vocab) for _ in range(q)], sl - q, [perm.pop() for _ in range(-(-sl // BS))]))
    return chunks


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)).item()


def graph_checks(model: CausalLM, kv: list[torch.Tensor]) -> CudaGraphRunner:
    print("== (b) CUDA graph replay vs eager (1.5B shapes, random weights)", flush=True)
    enable_triton(model, True)
    graphs = CudaGraphRunner(model, kv, max_batch=16, query_lens=(1, 1 + K), block_size=BS,
                             max_blocks_per_seq=512, with_logits=True)
    rows.append(("graph capture (s)", "", "", "", f"{graphs.capture_seconds:.1f}", "", ""))
    # The same padded forward, run eagerly: a replay must equal it bitwise (same kernels, same
    # shapes). Against the unpadded eager forward only rounding differs (another split-K factor).
    padded = CudaGraphRunner(model, kv, max_batch=16, query_lens=(1, 1 + K), block_size=BS,
                             max_blocks_per_seq=512, with_logits=True, capture=False)
    rng = random.Random(1)
    vocab = model.config.vocab_size
    for n in (1, 3, 16):
        for q in (1, 1 + K):
            worst_g, worst_r, agree, bitwise = 0.0, 0.0, [], True
            for _ in range(4):  # fresh metadata every replay
                chunks = random_step(n, q, rng, vocab)
                ids, pos, meta = build_batch(chunks, BS, DEV)
                out = graphs.run(ids, pos, meta, n, q)
                assert out is not None
                g_logits, g_hidden = out.logits.clone(), out.hidden
                p_out = padded.run(ids, pos, meta, n, q)
                bitwise &= torch.equal(g_hidden, p_out.hidden) and torch.equal(g_logits, p_out.logits)
                h_eager, _ = model(ids, pos, meta, kv)
                e_logits = model.compute_logits(h_eager)
                triton_backend, model.attn_backend = model.attn_backend, ReferenceBackend()
                h_ref, _ = model(ids, pos, meta, kv)
                model.attn_backend = triton_backend
                worst_g = max(worst_g, rel(out.hidden, h_eager))
                worst_r = max(worst_r, rel(h_eager, h_ref))
                agree.append((g_logits.argmax(-1) == e_logits.argmax(-1)).float().mean().item())
            check(bitwise and worst_g < 5e-2 and min(agree) > 0.9,
                  f"graph == padded eager bitwise: {bitwise}; graph vs unpadded eager n={n} q={q}: rel err "
                  f"{worst_g:.1e}, argmax agree {min(agree):.3f} "
                  f"(eager triton vs reference rel err {worst_r:.1e})")
    return graphs


def timed(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def step_fns(model, kv, graphs, ids, pos, meta, n, q, with_reference):
    """The step variants to time, each a no-argument function (logits included)."""
    eager = lambda: model.compute_logits(model(ids, pos, meta, kv)[0])  # noqa: E731
    modes = {"eager reference": eager} if with_reference else {}
    modes["eager triton"] = eager
    if meta.block_tables.shape[1] <= graphs.max_blocks:
        modes["graph triton"] = lambda: graphs.run(ids, pos, meta, n, q)
    return modes


def timing(model: CausalLM, kv: list[torch.Tensor], graphs: CudaGraphRunner) -> None:
    print("== (c) timing", flush=True)
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rng = random.Random(2)
    for ctx in (1024, 8192):
        for n, q in ((1, 1), (1, 1 + K), (16, 1)):
            if ctx == 8192 and n > 1:
                continue
            perm = list(range(NUM_BLOCKS - 1))
            rng.shuffle(perm)
            chunks = [SeqChunk([rng.randrange(cfg.vocab_size) for _ in range(q)], ctx - q,
                               [perm.pop() for _ in range(-(-ctx // BS))]) for _ in range(n)]
            t0 = time.perf_counter()
            ids, pos, meta = build_batch(chunks, BS, DEV)
            host_ms = (time.perf_counter() - t0) * 1e3
            kv_bytes = n * cfg.num_layers * 2 * ctx * cfg.num_kv_heads * cfg.head_dim * 2
            modes = step_fns(model, kv, graphs, ids, pos, meta, n, q, with_reference=n * q <= 5)
            for name, fn in modes.items():
                enable_triton(model, name != "eager reference")
                ms = timed(fn)
                frac = (weight_bytes + kv_bytes) / (ms * 1e-3) / HBM
                rows.append((name, n, q, ctx, f"{ms:.3f}", f"{n * q * 1e3 / ms:.0f}", f"{frac:.1%}"))
                print(f"  {name:16s} B={n:<3d} q={q} ctx={ctx}: {ms:.3f} ms/step (build_batch {host_ms:.2f} ms host)", flush=True)
    # attention alone, one layer, batch 1 decode at 8k context: split-K vs not
    meta_chunks = [SeqChunk([0], 8191, list(range(512)))]
    _, _, meta = build_batch(meta_chunks, BS, DEV, with_reference=False)
    qt = torch.randn(1, cfg.num_heads, cfg.head_dim, device=DEV, dtype=torch.bfloat16)
    for s in (1, 8, None, 64):
        us = timed(lambda s=s: pa.triton_attention(qt, kv[0], meta, 0.1, num_splits=s), 200) * 1e3
        rows.append((f"attn 1 layer splits={s or 'auto'} (us)", 1, 1, 8192, f"{us:.1f}", "", ""))


def main() -> int:
    assert torch.cuda.is_available(), "needs CUDA"
    start = time.perf_counter()
    kernel_checks()
    model = random_model()
    cfg = model.config
    kv = allocate_kv_cache(cfg.num_layers, NUM_BLOCKS, BS, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, DEV)
    for c in kv:
        c.normal_()
    graphs = graph_checks(model, kv)
    timing(model, kv, graphs)
    print(f"\n{'mode':32s} {'B':>3s} {'q':>2s} {'ctx':>5s} {'ms/step':>8s} {'tok/s':>7s} {'of 4.3TB/s':>10s}")
    for r in rows:
        print(f"{r[0]:32s} {r[1]!s:>3s} {r[2]!s:>2s} {r[3]!s:>5s} {r[4]:>8s} {r[5]:>7s} {r[6]:>10s}")
    print(f"\n{len(failures)} failures; total {time.perf_counter() - start:.0f}s")
    for f in failures:
        print("  FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
