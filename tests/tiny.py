"""Tiny random-weight models for fast engine tests (real tokenizer, real engine code)."""

from __future__ import annotations

import functools

import torch

from verispec.attention.reference import ReferenceBackend
from verispec.config import EngineConfig, ModelConfig, SpeculativeConfig
from verispec.engine.builder import assemble_parts
from verispec.engine.engine import LLMEngine
from verispec.loader.model_loader import DTYPES
from verispec.models.qwen2 import CausalLM, build_model


@functools.cache
def real_tokenizer():
    from verispec.loader.registry import resolve_model
    from verispec.loader.tokenizer import Tokenizer

    return Tokenizer.from_gguf(resolve_model("qwen2.5-coder-0.5b-instruct", progress=False))


def tiny_config(arch: str = "qwen2", vocab: int = 4096, layers: int = 2) -> ModelConfig:
    return ModelConfig.for_arch(
        arch, vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=layers, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False,
    )


def tiny_model(cfg: ModelConfig | None = None, seed: int = 0) -> CausalLM:
    cfg = cfg or tiny_config()
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in CausalLM(cfg).named_parameters()}
    sd = {}
    for n, shape in shapes.items():
        if n.endswith("norm.weight"):
            sd[n] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            sd[n] = torch.randn(shape, generator=g) * (0.5 if "embed" in n else 0.08)
    return build_model(cfg, sd, torch.device("cpu"), torch.float32)


class CheapDrafts:
    """A step cost under which drafts pay when they are accepted, less so as the batch grows (the tiny
    model's analytic CPU cost prices a drafter forward so high that the self oracle would never draft):
    for tests of the adaptive policy's plumbing that need drafts to happen."""

    def seconds(self, k: int, batch: int) -> float:
        return 1.0 + 0.04 * k * batch


def tiny_engine(
    model: CausalLM | None = None, spec: dict | None = None, draft_override: CausalLM | None = None,
    step_cost=None, **kw
) -> LLMEngine:
    """An engine around a tiny model (or any built CausalLM: the engine runs on the model's device in its
    dtype, so the real 0.5B on CUDA gets CUDA graphs and the Triton kernels). kw override EngineConfig
    fields; draft_override is the model that a draft_model speculative_config drafts with (instead of
    loading its registry name); step_cost: the adaptive policy's cost model (None: the engine's own,
    analytic on CPU).

    No gc.freeze at start-up unless kw asks for it (gc_freeze=True, the engine's default): each freeze
    is a full collection (~0.2 s here), which the many engines of the tests would pay again and again.

    A model may carry `engine_defaults` (a dict of EngineConfig fields, e.g. conftest.qwen05_gate's
    batch_invariant=True in bf16 on CUDA): every engine built on it gets them unless kw overrides them, so
    that no engine switches the shared model's kernels off the mode its gate runs in."""
    model = model or tiny_model()
    draft = None if draft_override is None else (real_tokenizer(), draft_override.config, draft_override)
    p = next(model.parameters())
    dtype = next(name for name, d in DTYPES.items() if d == p.dtype)
    defaults = dict(model="tiny", device=str(p.device), dtype=dtype, max_num_batched_tokens=256, num_gpu_blocks=256,
                    gc_freeze=False, **getattr(model, "engine_defaults", {}))
    cfg = EngineConfig(**{**defaults, **kw}, speculative_config=SpeculativeConfig.from_dict(spec))
    parts = assemble_parts(cfg, real_tokenizer(), model, p.device, p.dtype, draft_model=draft, step_cost=step_cost)
    return LLMEngine(cfg, parts)


def run_all(engine: LLMEngine, prompts: list[list[int]], params) -> list:
    """Add token-id prompts, step to completion, return finished outputs in order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", None, sp, p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(prompts))]


@functools.cache
def text_model() -> CausalLM:
    """A tiny model over the real tokenizer's whole vocabulary (for text prompts: server tests)."""
    return tiny_model(tiny_config(vocab=151936))


def greedy_continuation(model: CausalLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The model's greedy continuations (float32, batched over the prompts, no engine)."""
    from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch

    c, dev = model.config, torch.device("cpu")
    per_seq = -(-(max(map(len, prompts)) + n) // 16)
    kv = allocate_kv_cache(c.num_layers, per_seq * len(prompts), 16, c.num_kv_heads, c.head_dim, torch.float32, dev)
    chunks = [SeqChunk(p, 0, list(range(per_seq * i, per_seq * (i + 1)))) for i, p in enumerate(prompts)]
    outs: list[list[int]] = [[] for _ in prompts]
    for _ in range(n):
        ids, pos, meta = build_batch(chunks, 16, dev)
        hidden, _ = model(ids, pos, meta, kv)
        nxt = model.compute_logits(hidden[meta.query_start_loc[1:].long() - 1]).argmax(-1).tolist()
        for o, t in zip(outs, nxt, strict=True):
            o.append(t)
        chunks = [SeqChunk([t], ch.start + len(ch.token_ids), ch.block_ids) for ch, t in zip(chunks, nxt, strict=True)]
    return outs


def trained_tiny_drafter(model: CausalLM, seqs: list[tuple[list[int], list[int]]], block_size: int, mask_id: int,
                         steps: int = 15, lr: float = 1e-2, anchors: int = 8):
    """A 1-layer DFlash drafter briefly fitted to (prompt, response) pairs of `model` (responses
    its greedy continuations): some drafts right, most wrong. Returns (drafter in eval mode, samples)."""
    from verispec.spec_decode.dflash_model import DFlashDrafter, new_config
    from verispec.train import data as dflash_data
    from verispec.train import objective

    cfg = new_config(model, "tiny", mask_id, block_size=block_size, num_layers=1)
    samples = dflash_data.extract_features(model, seqs, tuple(cfg.target_layers), torch.float32, 4096)
    d = DFlashDrafter(cfg)
    d.init_weights(0)
    d.requires_grad_(True)
    opt = torch.optim.AdamW(d.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        loss, _ = objective.dflash_loss(d, model, objective.make_batch(samples, anchors, cfg, gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.requires_grad_(False).eval(), samples


def metadata_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta, scale: float, window: int = 0) -> torch.Tensor:
    """triton_attention's contract in plain torch, reading only the metadata tensors (so, unlike
    reference_attention, it can back a CudaGraphRunner(capture=False); fast on CPU): query i of a
    sequence with q_len queries sees context positions [0, seq_len - q_len + i]; a query with no
    visible key gets zeros; window > 0 also masks keys at positions <= query position - window."""
    out = torch.zeros_like(q)
    qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    bs, rep = meta.block_size, q.shape[1] // kv_cache.shape[2]
    for b, sl in enumerate(lens):
        t0, t1 = qsl[b], qsl[b + 1]
        if t1 == t0 or sl <= 0:
            continue
        pos = torch.arange(sl, device=q.device)
        slots = meta.block_tables[b].long()[pos // bs] * bs + pos % bs
        k, v = (kv_cache[i][slots].float().repeat_interleave(rep, dim=1) for i in (0, 1))
        s = torch.einsum("qhd,lhd->hql", q[t0:t1].float(), k) * scale
        qpos = sl - (t1 - t0) + torch.arange(t1 - t0, device=q.device)
        hidden = pos[None, None, :] > qpos[None, :, None]
        if window:
            hidden |= pos[None, None, :] <= qpos[None, :, None] - window
        s = s.masked_fill(hidden, float("-inf"))
        p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)  # rows without a visible key: zeros
        out[t0:t1] = torch.einsum("hql,lhd->qhd", p, v).to(q.dtype)
    return out


class MetadataBackend(ReferenceBackend):
    """An attention backend with the Triton backend's contract in plain torch (metadata_attention):
    graph-safe by contract, no reference indices; K/V written as the reference writes them."""

    name = "metadata"
    supports_graphs = True
    needs_reference_indices = False

    def prepare_metadata(self, *args, **kwargs):
        return {}

    def forward(self, q, kv_cache, meta, scale, prefetch=None, window=0):
        return metadata_attention(q, kv_cache, meta, scale, window)


def hf_logits(hf, seq: list[int]) -> torch.Tensor:
    """A transformers model's float32 logits at every position of seq."""
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0].float()


def prefill_logits(llm, seq: list[int], last: bool = False) -> torch.Tensor:
    """One prefill of seq through an LLM's model and KV cache (blocks borrowed and given back): its float32
    logits at every position, or (last=True) at the last one only."""
    from verispec.worker.inputs import SeqChunk, build_batch

    engine = llm.engine
    owned: list[int] = []
    assert engine.blocks.allocate(owned, len(seq))
    try:
        inp, pos, meta = build_batch([SeqChunk(seq, 0, owned)], engine.blocks.block_size, engine.runner.device)
        with torch.inference_mode():
            hidden, _ = engine.runner.model(inp, pos, meta, engine.runner.kv_caches)
            logits = engine.runner.model.compute_logits(hidden[-1:] if last else hidden)
        return logits[0] if last else logits
    finally:
        engine.blocks.free_blocks(owned)
