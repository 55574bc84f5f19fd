"""DFlash's training objective: random anchors packed into blocks, the drafter's forward over them, and the
position-decayed block cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verispec.models.qwen2 import CausalLM
from verispec.spec_decode.dflash_model import DFlashConfig, DFlashDrafter, block_attention_mask
from verispec.train.data import Sample


def make_batch(samples: list[Sample], anchors_per_seq: int, cfg: DFlashConfig, gen: torch.Generator) -> dict:
    """Draw `anchors_per_seq` anchors in each sample's response (positions prompt_len .. len-2)
    and pack the blocks (see pack_blocks)."""
    anchors = torch.empty(len(samples), anchors_per_seq, dtype=torch.long)
    for i, x in enumerate(samples):
        n = x.tokens.numel()
        lo = min(x.prompt_len, n - 2)
        anchors[i] = torch.randint(lo, n - 1, (anchors_per_seq,), generator=gen).sort().values
    return pack_blocks(samples, anchors, cfg)


def pack_blocks(samples: list[Sample], anchors: torch.Tensor, cfg: DFlashConfig) -> dict:
    """The training inputs for blocks at the given anchors [S, A] (absolute positions).

    Block at anchor p: tokens [tok[p], MASK x (B-1)] at positions p .. p+B-1, context = target
    features of positions < p, labels tok[p+j] for j = 1 .. B-1 (-100 past the sequence end)."""
    s, b, dev = len(samples), cfg.block_size, samples[0].feats.device
    a = anchors.shape[1]
    lens = torch.tensor([x.tokens.numel() for x in samples])
    ctx = int(lens.max())
    feats = samples[0].feats.new_zeros(s, ctx, samples[0].feats.shape[1])
    toks = torch.zeros(s, ctx + b, dtype=torch.long, device=dev)
    for i, x in enumerate(samples):
        n = x.tokens.numel()
        feats[i, :n], toks[i, :n] = x.feats, x.tokens
    anchors, lens = _to_device(anchors, dev), _to_device(lens, dev)
    idx = anchors[:, :, None] + torch.arange(b, device=dev)  # [S, A, B] absolute positions
    labels = toks.gather(1, idx.view(s, -1)).view(s, a, b)
    labels = labels.masked_fill((idx >= lens[:, None, None]) | (idx == anchors[:, :, None]), -100)
    block = torch.full_like(labels, cfg.mask_token_id)
    block[:, :, 0] = toks.gather(1, anchors)
    valid = torch.arange(ctx, device=dev)[None, :] < lens[:, None]
    return dict(feats=feats, anchors=anchors, block=block.view(s, -1), labels=labels.view(s, -1),
                positions=idx.view(s, -1).clamp(max=cfg.max_position_embeddings - 1), valid=valid)


def _to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor on `dev` without a stream sync (pinned + non-blocking on CUDA)."""
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)


def block_hidden(drafter: DFlashDrafter, target: CausalLM, batch: dict) -> torch.Tensor:
    """The drafter's final hidden states [S, A*B, H] for a packed batch (feed to target.compute_logits)."""
    s, ctx, nf = batch["feats"].shape
    pos = torch.arange(ctx, device=batch["feats"].device).repeat(s)
    ctx_kv = [(k.view(s, ctx, *k.shape[1:]), v.view(s, ctx, *v.shape[1:]))
              for k, v in drafter.context_kv(batch["feats"].reshape(s * ctx, nf), pos)]
    mask = block_attention_mask(batch["anchors"], batch["valid"], drafter.config.block_size)
    emb = target.embed(batch["block"]).float()  # residual stream in float32 (autocast does the matmuls)
    return drafter(emb, batch["positions"], ctx_kv, mask)


def dflash_loss(drafter: DFlashDrafter, target: CausalLM, batch: dict, with_stats: bool = True) -> tuple[torch.Tensor, dict]:
    """Position-decayed block cross-entropy over block positions 1 .. B-1 (no host sync).

    Stats (with_stats; they sync): per-position accuracy and `tau_uniform`, the mean number of leading
    correct drafts + 1 over uniformly drawn anchors. tau_uniform overestimates the engine's acceptance
    length (it weighs positions, the engine weighs steps, which crowd where acceptance is low);
    evaluate() reports the engine's semantics as `tau`."""
    b = drafter.config.block_size
    hidden = block_hidden(drafter, target, batch)
    s, h = hidden.shape[0], hidden.shape[-1]
    rows = hidden.reshape(s, -1, b, h)[:, :, 1:].reshape(-1, h)  # position 0 holds the anchor's own token
    labels = batch["labels"].reshape(s, -1, b)[:, :, 1:].reshape(-1)  # -100 past the sequence end
    logits = target.compute_logits(rows)
    ce = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    j = torch.arange(1, b, device=labels.device).repeat(labels.numel() // (b - 1))
    w = torch.exp(-(j - 1).float() / drafter.config.loss_gamma) * (labels >= 0)
    loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    if not with_stats:
        return loss, {}
    with torch.no_grad():
        grid = (logits.argmax(-1) == labels).view(-1, b - 1)
        valid = (labels >= 0).view(-1, b - 1)
        acc = (grid.sum(0).float() / valid.sum(0).clamp_min(1)).tolist()
        tau = 1 + grid.long().cumprod(-1).sum(-1).float().mean().item()
    return loss, {"acc_per_pos": [round(a, 4) for a in acc], "tau_uniform": tau}
