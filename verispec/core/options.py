"""KernelOptions: the tuning of the CUDA kernel path, one frozen object given to whoever launches kernels.

The model (models/kernel_path.enable_triton), the Triton attention backend (attention/triton.py) and
the CUDA-graph runner (worker/graphs.py) get it when they are built, and every kernel entry point in
verispec/kernels takes it as `options=`; nothing on the hot path reads a module global or the
environment. The defaults are the measured best on the H200 (docs/BENCHMARKS.md); an A/B run builds a
variant with dataclasses.replace (scripts/step_ablation.py, scripts/step_trace.py) and switches a
model onto it before its engine or graph runner is built:

    enable_triton(model, options=KernelOptions(pdl=False))  # e.g. isolated kernel times, or a suspected race
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelOptions:
    """Fields are grouped by their user; each says what it changes and where its default comes from."""

    # Every Triton kernel (kernels/pdl.py): programmatic dependent launch on Hopper and newer. Off only
    # to time kernels in isolation (`verispec bench profile --no-pdl`) or to rule out a race: the
    # batch-1 replay is 1,250 us without it against 1,092 with it (BENCHMARKS.md, session 7).
    pdl: bool = True

    # The Triton attention backend (attention/triton.py, kernels/paged_attention.py).
    attn_programs_per_sm: int = 2  # split-K aims at this many programs per SM (2 beat 1 and 4: session 4)
    attn_num_splits: int | None = None  # force the split-K factor (A/B); None: from shapes (graph-safe)
    # L2 prefetch of the next MLP weight from the attention launch (kernels/l2_prefetch.py): how much of
    # gate_up is asked for (0: off; 4 MB beat 0..48 MB), and only in steps of at most this many
    # sequences and tokens (more lost: session 7).
    l2_prefetch_bytes: int = 4 << 20
    l2_prefetch_max_seqs: int = 2
    l2_prefetch_max_rows: int = 8

    # Linear layers (kernels/linear.py): rows splitk_min_rows..splitk_max_rows take the split-K GEMM,
    # cuBLAS above (33..64 won against cuBLAS; 32, 128 and 256 rows lost: session 5).
    splitk_min_rows: int = 33
    splitk_max_rows: int = 64
    # Steps of at most gemv_max_rows rows (batch-1 decode; a batch-1 verify of up to that many
    # queries) take the weight-resident GEMV for every linear layer and the fused layer path (each norm
    # in its projection's prologue, rotary + K/V write in the qkv kernel). 1: decode only (session 5:
    # at 4 rows the GEMV lost to cuBLAS on gate_up and down). The verify A/B: scripts/step_ablation.py
    # --query-len Q --variants base,gemv=Q.
    gemv_max_rows: int = 1
    # 2..SKINNY_MAX_ROWS rows of a layer with K >= 4N (down_proj), which the skinny kernel does not
    # split over K: the split-K kernel instead of cuBLAS.
    small_splitk: bool = False
    # Steps of 2..small_m_max_rows rows (a batch-1 verify of k <= 15 drafts; up to 16) take the small-M
    # tensor-core kernels (kernels/small_m.py, small_m_qkv.py) for every linear layer, the LM head included, and the
    # fused layer path (norms in the qkv / gate_up prologues, rotary + K/V write in the qkv kernel).
    # 0: off, the paths above (default until the H200 measures it: scripts/gpu_verify.sh).
    # (Session 28 also measured small-M only for the fused kernels, o / down / the LM head on linear.py's picks:
    # 1.52x of decode at 4 queries against the default's 1.28x, so that option was removed in session 29.)
    small_m_max_rows: int = 0
    # Steps of 2..fused_qkv_max_rows rows (above gemv_max_rows, not on the small-M path): the one-row family's
    # norm + qkv + rotary + K/V write kernel (kernels/qkv_rope.py) for the attention's input, which drops the
    # input norm's and the rotary's launches (~4.5 us a layer at 4 rows: session 28's verify profile); the rest
    # of the layer as unfused (o, norm, gate_up, down on linear.py's picks). Its GEMV reduces row by row, so it
    # pays only for a few rows (qkv at 8 rows: 8.0 us against the skinny kernel's 4.5, session 11). Session 28's
    # A/B on an H100 (scripts/step_ablation.py --variants base,fused-qkv=4,..., docs/BENCHMARKS.md): 2 queries
    # 1,666 -> 1,611 us (verify / decode 1.242 -> 1.201), 4 queries 1,721 -> 1,736 (a loss). 0: off, until the
    # real-model GPU test (tests/test_decode_gpu.py [fused-qkv]) has run; 2 is the candidate default. (Session
    # 28 also measured the post-attention norm in the skinny gate_up kernel's K loop on this path: 4 queries
    # 1,736 -> 2,659 us, so that variant was removed.)
    fused_qkv_max_rows: int = 0
    # GGUF weights (kernels/gguf_matmul.py), one row of Q4_K / Q6_K: the integer-dot GEMV (x quantized to int8
    # per 32 elements in the kernel, dp4a on the weights' quants, as llama.cpp) instead of the float one, which
    # is bound by unpacking each weight element (session 14: 22-26% of HBM bandwidth). Off until the H200
    # measures it (scripts/gguf_bench.py --int8); it rounds x to 8 bits, so it is also not the float path's
    # arithmetic (tests/test_gguf_matmul.py bounds the difference).
    gguf_int8_gemv: bool = False
    # GGUF weights, one row of Q4_K with bfloat16 x: kernels/gguf_gemv.py's GEMV (a few full-rate instructions a
    # weight, one reduction after the loop) instead of gguf_matmul's super-block GEMV (~43 instructions a
    # weight in offline sm_90 SASS). Session 24's one-ulp test failed on the H100 near zero outputs, a bound no
    # float32 dot meets; under its float32 error bound it passes there (session 25), and with session 25's tiles
    # it is 8-17% faster than the old kernel at every 1.5B shape; on the 1.5B's Q4_K_M shapes and types the
    # batch-1 step replays in 1,597 us against 1,715 (H100, session 26, docs/BENCHMARKS.md): on by default.
    gguf_gemv1: bool = True
    # One row of Q6_K with bfloat16 x (the 1.5B's LM head, half its down and v projections: 502 of the batch-1
    # step's 1,259 us of GEMVs on the old kernel, session 28's H100 profile): kernels/gguf_gemv.py's resident
    # Q6_K GEMV (every byte of a program's rows requested before the PDL wait). Off until a GPU has timed it.
    gguf_gemv1_q6k: bool = False
    # One row of Q4_K on gguf_gemv1: the resident form (the row's bytes requested at once, not a loop whose steps
    # each wait for memory). Off until a GPU has timed it.
    gguf_gemv1_resident: bool = False

    # CUDA graphs (worker/graphs.py): stage a replay's inputs (and fill its placeholders) with one
    # kernel; False: the torch copies and fills (session 6: the kernel won at batch 1 and in host
    # time per call; a batch-16 speculative run was within the spread either way).
    stage_kernel: bool = True

    # Batch invariance (EngineConfig.batch_invariant; off by default): a row's result does not depend on
    # the other rows of the step. Every linear layer runs one split-K kernel config per weight for every
    # row count (kernels/invariant.py: no GEMV / skinny / cuBLAS switching by shape, and no one-row fused
    # decode path); attention splits each sequence's keys at fixed positions, every invariant_kv_split
    # keys (a multiple of its 64-key tile), with one query tile size for decode, verify and prefill,
    # and merges the splits in one order (kernels/paged_attention.py).
    batch_invariant: bool = False
    invariant_kv_split: int = 256

    def __post_init__(self) -> None:
        """A bad value is a ValueError when the options are built, before any kernel runs."""
        if not 0 <= self.small_m_max_rows <= 16:
            raise ValueError(f"small_m_max_rows must be 0 (off) or up to 16, got {self.small_m_max_rows}")
        if not 0 <= self.fused_qkv_max_rows <= 16:
            raise ValueError(f"fused_qkv_max_rows must be 0 (off) or up to 16, got {self.fused_qkv_max_rows}")


DEFAULT_OPTIONS = KernelOptions()
