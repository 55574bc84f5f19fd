"""How good a drafter is on held-out sequences: loss and per-position accuracy, and acceptance counted as the
engine counts it (acceptance_walk; engine_walk with an engine's own target and drafter)."""

from __future__ import annotations

import torch

from verispec.core.counters import SpecCounters
from verispec.models.qwen2 import CausalLM
from verispec.spec_decode.dflash_model import DFlashConfig, DFlashDrafter
from verispec.train.data import Sample, extract_features
from verispec.train.objective import block_hidden, dflash_loss, make_batch, pack_blocks
from verispec.train.options import TrainOptions


@torch.no_grad()
def evaluate(drafter, target, val: list[Sample], opts: TrainOptions, cfg: DFlashConfig) -> tuple[float, dict]:
    """Loss and stats on held-out sequences: loss, per-position accuracy and tau_uniform at fixed
    random anchors (seed 1234); `tau` and `accepted_per_pos` from acceptance_walk (the engine's) over
    the greedy ones, `tau_first128` over their first 128 response tokens (dflash_eval's length)."""
    drafter.eval()
    gen = torch.Generator().manual_seed(1234)
    dev = target.lm_head_weight.device
    losses, taus, accs = [], [], []
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        for i in range(0, len(val), opts.batch_seqs):
            loss, st = dflash_loss(drafter, target, make_batch(val[i : i + opts.batch_seqs], opts.anchors, cfg, gen))
            losses.append(loss.item())
            taus.append(st["tau_uniform"])
            accs.append(st["acc_per_pos"])
        greedy = [x for x in val if x.greedy] or val
        walk = acceptance_walk(drafter, target, greedy)
        walk128 = acceptance_walk(drafter, target, [truncate(x, 128) for x in greedy])
    drafter.train()
    acc = [round(sum(a[j] for a in accs) / len(accs), 4) for j in range(len(accs[0]))]
    return sum(losses) / len(losses), {"tau": walk["tau"], "accepted_per_pos": walk["accepted_per_pos"],
                                       "num_drafts": walk["num_drafts"], "num_walked": len(greedy),
                                       "tau_first128": walk128["tau"], "tau_uniform": sum(taus) / len(taus),
                                       "acc_per_pos": acc}


def truncate(x: Sample, response_tokens: int) -> Sample:
    """The sample cut after its first `response_tokens` response tokens."""
    n = x.prompt_len + response_tokens
    return Sample(x.tokens[:n], x.feats[:n], x.prompt_len, x.group, x.greedy)


@torch.no_grad()
def leading_matches(drafter: DFlashDrafter, target: CausalLM, sample: Sample, anchors_per_pass: int = 256) -> list[int]:
    """For every anchor p in the response (prompt_len .. len-2): how many leading drafts of the
    block at p equal the sample's tokens p+1, p+2, ... (at most B-1; none past the end)."""
    b, n = drafter.config.block_size, sample.tokens.numel()
    lo = min(sample.prompt_len, n - 1)
    out: list[int] = []
    for a0 in range(lo, n - 1, anchors_per_pass):
        anchors = torch.arange(a0, min(a0 + anchors_per_pass, n - 1))
        batch = pack_blocks([sample], anchors[None], drafter.config)
        hidden = block_hidden(drafter, target, batch).view(len(anchors), b, -1)[:, 1:]
        drafts = target.compute_logits(hidden).argmax(-1)  # [A, B-1]
        ok = drafts == batch["labels"].view(len(anchors), b)[:, 1:]  # labels past the end are -100
        out += ok.long().cumprod(-1).sum(-1).tolist()
    return out


def acceptance_walk(drafter: DFlashDrafter, target: CausalLM, samples: list[Sample], k: int | None = None) -> dict:
    """Acceptance counted as the engine counts it when it decodes each response greedily with
    max_tokens = the response's length: the first response token comes from the prefill, then each
    step drafts min(k, tokens left - 1) tokens from the block anchored at the last accepted token,
    accepts the leading matches and adds one target token. Steps crowd where acceptance is low, so
    this is lower than averaging over uniform anchors. Exact for greedy responses (the target's own
    greedy tokens, --temperature 0): the engine accepts those drafts and no others."""
    k = drafter.config.block_size - 1 if k is None else min(k, drafter.config.block_size - 1)
    c = SpecCounters()
    for x in samples:
        n = x.tokens.numel()
        lo = min(x.prompt_len, n - 1)
        matches = leading_matches(drafter, target, x)
        p = lo
        while p < n - 1:
            kp = min(k, n - p - 2)
            if kp <= 0:  # the last token: a plain decode step, no drafts
                p += 1
                continue
            acc = min(matches[p - lo], kp)
            c.record(kp, acc)
            p += acc + 1
    d = max(c.num_drafts, 1)
    return {"tau": 1 + c.num_accepted_tokens / d, "num_drafts": c.num_drafts,
            "num_draft_tokens": c.num_draft_tokens, "num_accepted_tokens": c.num_accepted_tokens,
            "accepted_per_pos": [round(a / d, 4) for a in c.accepted_per_pos]}


def engine_walk(engine, seqs: list[tuple[list[int], list[int]]], k: int | None = None) -> dict:
    """acceptance_walk over (prompt ids, output ids) the engine produced greedily, with the engine's
    own target and drafter (teacher-forced target features, training's block forward). Equal to the
    engine's counters for the same outputs unless the engine's drafting path differs from training's
    (on the GPU: bf16, CUDA graphs, fused kernels)."""
    target, drafter = engine.parts.model, engine.proposer.drafter
    dev = target.lm_head_weight.device
    samples = extract_features(target, seqs, tuple(drafter.config.target_layers), target.lm_head_weight.dtype, 16384)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        return acceptance_walk(drafter, target, samples, k)
