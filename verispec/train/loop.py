"""`verispec train-drafter`: train a DFlash drafter for a target model, from nothing but the target.

1. Data (train/prompts.py, train/data.py): function stubs mined from the stdlib and
   --prompt-sources packages, rendered in --prompt-styles; the target answers each through verispec
   (response 0 greedy by default, --responses-per-prompt - 1 extra sampled ones); generation stops
   at its deadline or once the features would exceed --max-feature-gb; one teacher-forced target
   forward per sequence captures the drafter's target layers. Held-out data is split by prompt.
2. Training: random anchors inside each response; block = [token at anchor, MASK x (B-1)] at
   positions anchor .. anchor+B-1, context = features of positions < anchor; several blocks per
   sequence, kept apart by the mask; cross-entropy weighted exp(-(j-1)/gamma) at block position j;
   AdamW, bf16 autocast on CUDA, checkpoints every --ckpt-every steps and at the end.
The time budget (--minutes) covers everything after the target is loaded (mining included);
generation gets at most --gen-fraction of it; the learning rate follows a cosine over the time left
for training. Runs can
be split: --generate-only writes OUT/sequences.jsonl; --sequences FILE skips generation; --resume
continues from OUT/train_state.pt (float32 weights + optimizer state).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from verispec.core.counters import SpecCounters
from verispec.models.qwen2 import CausalLM
from verispec.spec_decode.dflash import save_drafter
from verispec.spec_decode.dflash_model import DFlashConfig, DFlashDrafter, block_attention_mask, new_config
from verispec.train.data import (
    Sample,
    Seq,
    extract_features,
    generate,
    load_sequences,
    make_jobs,
    pick_mask_token,
    save_sequences,
)
from verispec.train.prompts import STYLES, mine_functions, render_styled, source_roots

# Tests set this to a callable (TrainOptions) -> LLMEngine to train against a tiny model.
ENGINE_FACTORY = None


@dataclass
class TrainOptions:
    target: str
    out: str
    minutes: float = 20.0
    gen_fraction: float = 0.45
    num_prompts: int = 5000
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    device: str = "auto"
    block_size: int = 16
    layers: int = 2
    target_layers: int = 5
    seed: int = 0
    temperature: float = 0.0
    batch_seqs: int = 32
    anchors: int = 16
    lr: float = 6e-4
    warmup: int = 100
    ckpt_every: int = 500
    max_steps: int | None = None
    max_num_seqs: int = 256
    val_fraction: float = 0.03
    save_dtype: str = "bfloat16"
    feature_batch_tokens: int = 16384
    max_feature_gb: float = 60.0
    prompt_sources: str = "stdlib"
    prompt_styles: str = "chat"
    max_stub_chars: int = 1500
    responses_per_prompt: int = 1
    extra_temperature: float = 0.7
    refill_below: float = 0.75
    max_val_prompts: int = 256
    log_every: int = 20
    sequences: str | None = None
    generate_only: bool = False
    resume: bool = False
    save_state: bool = False


# ---- training ------------------------------------------------------------------------------
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


def build_prompts(tokenizer, opts: TrainOptions) -> list[list[int]]:
    """Prompt ids: mined stubs in the chosen styles, at most max_prompt_tokens long."""
    sources, styles = _csv(opts.prompt_sources), _csv(opts.prompt_styles)
    if bad := [s for s in styles if s not in STYLES]:
        raise ValueError(f"unknown prompt styles {bad} (choose from {', '.join(STYLES)})")
    present = []
    for src in sources:
        try:
            source_roots(src)
            present.append(src)
        except (ValueError, ImportError):
            print(f"prompt source {src!r} is not installed here: skipped")
    stubs = mine_functions(present, opts.num_prompts, opts.seed, opts.max_stub_chars)
    texts = render_styled(tokenizer, stubs, styles)
    ids = tokenizer.encode_batch(texts) if hasattr(tokenizer, "encode_batch") else [tokenizer.encode(t) for t in texts]
    kept = [p for p in ids if len(p) <= opts.max_prompt_tokens]
    print(f"{len(kept)} prompts ({len(stubs)} stubs from {', '.join(present)}; styles {', '.join(styles)})")
    return kept


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def feature_bytes_per_token(cfg: DFlashConfig, dev: torch.device) -> int:
    return len(cfg.target_layers) * cfg.hidden_size * (2 if dev.type == "cuda" else 4)


def make_sequences(engine, opts: TrainOptions, cfg: DFlashConfig, deadline: float) -> tuple[list[Seq], int]:
    """Mine prompts and generate (at most what fits in max_feature_gb); (sequences, number of prompts)."""
    prompts = build_prompts(engine.tokenizer, opts)
    jobs = make_jobs(prompts, opts.responses_per_prompt, opts.temperature, opts.extra_temperature, opts.seed)
    dev = engine.parts.model.lm_head_weight.device
    max_tokens = int(opts.max_feature_gb * 2**30 / feature_bytes_per_token(cfg, dev))
    seqs = generate(engine, jobs, opts.max_new_tokens, deadline, opts.refill_below, max_tokens)
    return seqs, len(prompts)


def release_serving_memory(engine, dev: torch.device) -> None:
    """Drop the target's serving KV cache and CUDA graphs (training needs neither)."""
    engine.runner.kv_caches = []
    engine.runner.graphs = None
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def feature_budget_gb(dev: torch.device, max_gb: float, headroom_gb: float = 32.0) -> float:
    """max_gb, lowered on CUDA to the free memory less headroom_gb for training's activations."""
    if dev.type != "cuda":
        return max_gb
    free, _ = torch.cuda.mem_get_info(dev)
    return max(1.0, min(max_gb, free / 2**30 - headroom_gb))


def split_by_group(samples: list[Sample], fraction: float, max_groups: int, seed: int) -> tuple[list, list]:
    """(val, train): all responses of a held-out prompt go to val (fraction of the prompts, at most
    max_groups; by sample when there is a single prompt)."""
    groups = sorted({s.group for s in samples})
    if len(groups) < 2:
        groups = list(range(len(samples)))
        samples = [Sample(s.tokens, s.feats, s.prompt_len, i, s.greedy) for i, s in enumerate(samples)]
    random.Random(seed).shuffle(groups)
    held = set(groups[: max(1, min(max_groups, int(len(groups) * fraction)))])
    return [s for s in samples if s.group in held], [s for s in samples if s.group not in held]


def lr_at(opts: TrainOptions, step: int, resumed: bool, frac: float) -> float:
    """Linear warm-up over opts.warmup steps, then a cosine from lr to lr / 10 over the budget."""
    warm = 1.0 if resumed else min(1.0, (step + 1) / opts.warmup)
    return opts.lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train(engine, opts: TrainOptions) -> dict:
    """The whole pipeline against an already built engine (its model is the target)."""
    t0 = time.monotonic()
    budget = opts.minutes * 60
    torch.manual_seed(opts.seed)
    target: CausalLM = engine.parts.model
    dev = target.lm_head_weight.device
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    mask_id = pick_mask_token(engine.tokenizer, target.config.vocab_size)
    cfg = new_config(target, opts.target, mask_id, opts.block_size, opts.layers, opts.target_layers)
    fp = cfg.target_fingerprint["sha256"]
    if opts.sequences:
        seqs, n_prompts = load_sequences(Path(opts.sequences), fp), 0
    else:
        deadline = t0 + budget * (1.0 if opts.generate_only else opts.gen_fraction)
        seqs, n_prompts = make_sequences(engine, opts, cfg, deadline)
        save_sequences(out / "sequences.jsonl", seqs, fp)
        print(f"{len(seqs)} sequences written to {out / 'sequences.jsonl'}")
    t_gen = time.monotonic() - t0
    if opts.generate_only:
        return {"num_sequences": len(seqs), "seconds_generate": t_gen}
    release_serving_memory(engine, dev)
    store = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gb = feature_budget_gb(dev, opts.max_feature_gb)
    samples = extract_features(target, seqs, tuple(cfg.target_layers), store, opts.feature_batch_tokens, gb)
    if len(samples) < len(seqs):
        print(f"features of {len(samples)} of {len(seqs)} sequences kept ({gb:.1f} GiB budget)")
    t_feat = time.monotonic() - t0 - t_gen
    if len(samples) < 2:
        raise ValueError(f"only {len(samples)} usable sequences; raise --minutes or --num-prompts")
    val, tr = split_by_group(samples, opts.val_fraction, opts.max_val_prompts, opts.seed)
    with torch.device(dev):
        drafter = DFlashDrafter(cfg)
    drafter.init_weights(opts.seed)
    drafter.requires_grad_(True).train()
    optim = torch.optim.AdamW(drafter.parameters(), lr=opts.lr, betas=(0.9, 0.95), weight_decay=0.01,
                              fused=dev.type == "cuda")
    step0 = 0
    if opts.resume and (out / "train_state.pt").is_file():
        state = torch.load(out / "train_state.pt", map_location=dev)
        drafter.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        step0 = state["step"]
        print(f"resumed from {out / 'train_state.pt'} at step {step0}")
    t_train0, end = time.monotonic(), t0 + budget - min(30.0, budget * 0.05)
    step, ema, stats = train_loop(drafter, target, optim, tr, opts, step0, end, out)
    val_loss, val_stats = evaluate(drafter, target, val, opts, cfg)
    sha = _checkpoint(drafter, optim, step, out, getattr(torch, opts.save_dtype), opts.save_state)
    log = dict(
        target=opts.target, target_fingerprint=fp, mask_token_id=mask_id, target_layers=cfg.target_layers,
        num_prompts=n_prompts, num_sequences=len(samples), num_train_sequences=len(tr),
        num_val_sequences=len(val), num_tokens=sum(s.tokens.numel() for s in samples),
        num_response_tokens=sum(s.tokens.numel() - s.prompt_len for s in samples),
        num_greedy_sequences=sum(s.greedy for s in samples), feature_budget_gb=round(gb, 1),
        seconds_generate=round(t_gen, 1), seconds_features=round(t_feat, 1),
        seconds_train=round(time.monotonic() - t_train0, 1), minutes_total=round((time.monotonic() - t0) / 60, 2),
        steps=step, resumed_from_step=step0, final_loss=ema, final_train_tau_uniform=stats.get("tau_uniform"),
        val_loss=val_loss, val=val_stats, weights_sha256=sha, options=asdict(opts),
    )
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(f"drafter saved to {out}: model.safetensors sha256 {sha}")
    print(f"val loss {val_loss:.3f}, val tau {val_stats['tau']:.2f} (the engine's greedy acceptance length on "
          f"held-out responses; first 128 tokens {val_stats['tau_first128']:.2f}; uniform-anchor estimate "
          f"{val_stats['tau_uniform']:.2f}), {step} steps, "
          f"{log['minutes_total']} min")
    return log


def train_loop(drafter: DFlashDrafter, target: CausalLM, optim, tr: list[Sample], opts: TrainOptions, step0: int,
               end: float, out: Path) -> tuple[int, float | None, dict]:
    """AdamW steps until `end` (or max_steps); the host syncs only every log_every steps."""
    dev, cfg = target.lm_head_weight.device, drafter.config
    gen = torch.Generator().manual_seed(opts.seed + step0)
    t_start = time.monotonic()
    step, ema, stats = step0, None, {}
    bar = tqdm(desc="training", unit="step", total=opts.max_steps, initial=step0)
    while (opts.max_steps is None or step < opts.max_steps) and (step == step0 or time.monotonic() < end):
        frac = (time.monotonic() - t_start) / max(end - t_start, 1e-6)
        if opts.max_steps:
            frac = max(frac, step / opts.max_steps)
        lr = lr_at(opts, step, step0 > 0, frac)
        for g in optim.param_groups:
            g["lr"] = lr
        batch = make_batch([tr[i] for i in torch.randint(len(tr), (opts.batch_seqs,), generator=gen)],
                           opts.anchors, cfg, gen)
        log = (step + 1) % opts.log_every == 0 or step == step0
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss, st = dflash_loss(drafter, target, batch, with_stats=log)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optim.step()
        step += 1
        bar.update(1)
        if log:
            stats = st
            ema = loss.item() if ema is None else 0.8 * ema + 0.2 * loss.item()
            bar.set_postfix(loss=f"{ema:.3f}", tau_u=f"{stats['tau_uniform']:.2f}", lr=f"{lr:.1e}")
        if opts.ckpt_every and step % opts.ckpt_every == 0:
            _checkpoint(drafter, optim, step, out, getattr(torch, opts.save_dtype), opts.save_state)
    bar.close()
    return step, ema, stats


def _checkpoint(drafter: DFlashDrafter, optim, step: int, out: Path, save_dtype, state: bool) -> str:
    """The servable drafter (save_dtype); with state, float32 weights + optimizer state for --resume."""
    if state:
        torch.save({"model": drafter.state_dict(), "optim": optim.state_dict(), "step": step}, out / "train_state.pt")
    return save_drafter(drafter, out, save_dtype)


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


# ---- CLI -----------------------------------------------------------------------------------
def add_train_parser(sub) -> None:
    s = sub.add_parser("train-drafter", help="train a DFlash drafter for a target model")
    s.add_argument("--target", required=True, help="registry name or path of the target model")
    s.add_argument("--out", required=True, help="directory for model.safetensors, config.json, train_log.json")
    for name, typ in [("minutes", float), ("num-prompts", int), ("max-new-tokens", int), ("block-size", int),
                      ("layers", int), ("seed", int), ("gen-fraction", float), ("target-layers", int),
                      ("batch-seqs", int), ("anchors", int), ("lr", float), ("ckpt-every", int),
                      ("max-steps", int), ("temperature", float), ("max-num-seqs", int), ("max-prompt-tokens", int),
                      ("warmup", int), ("val-fraction", float), ("max-val-prompts", int), ("max-feature-gb", float),
                      ("feature-batch-tokens", int), ("responses-per-prompt", int), ("extra-temperature", float),
                      ("refill-below", float), ("max-stub-chars", int), ("log-every", int)]:
        field = name.replace("-", "_")
        s.add_argument(f"--{name}", type=typ, default=TrainOptions.__dataclass_fields__[field].default)
    s.add_argument("--prompt-sources", default="stdlib",
                   help="comma-separated: stdlib and/or installed packages by import name (numpy,scipy,...)")
    s.add_argument("--prompt-styles", default="chat",
                   help=f"comma-separated, cycled over the prompts ({', '.join(STYLES)}; repeat one to weight it)")
    s.add_argument("--device", default="auto")
    s.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    s.add_argument("--sequences", default=None, help="JSONL of (prompt, response) ids from an earlier run")
    s.add_argument("--generate-only", action="store_true", help="stop after writing OUT/sequences.jsonl")
    s.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    s.add_argument("--save-state", action="store_true", help="write OUT/train_state.pt (for --resume; large)")
    s.set_defaults(func=cmd_train_drafter)


def cmd_train_drafter(args) -> int:
    fields = set(TrainOptions.__dataclass_fields__)
    opts = TrainOptions(**{k: v for k, v in vars(args).items() if k in fields})
    engine = (ENGINE_FACTORY or _load_engine)(opts)
    train(engine, opts)
    return 0


def _load_engine(opts: TrainOptions):
    from verispec.entrypoints.llm import LLM

    max_len = opts.max_prompt_tokens + opts.max_new_tokens + 32
    serve = opts.sequences is None  # with --sequences the engine never generates: no cache, no graphs
    blocks = opts.max_num_seqs * -(-max_len // 16) + 64 if serve else -(-max_len // 16) + 8
    llm = LLM(opts.target, device=opts.device, dtype="auto", max_model_len=max_len, max_num_seqs=opts.max_num_seqs,
              num_gpu_blocks=blocks, seed=opts.seed, max_num_batched_tokens=8192, enforce_eager=not serve)
    return llm.engine
