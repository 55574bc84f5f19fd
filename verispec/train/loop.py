"""The DFlash training pipeline behind `verispec train-drafter` (train/cli.py): a drafter for a target model,
from nothing but the target.

1. Data (train/prompts.py, train/data.py): function stubs mined from the stdlib and
   --prompt-sources packages, rendered in --prompt-styles; the target answers each through verispec
   (response 0 greedy by default, --responses-per-prompt - 1 extra sampled ones); generation stops
   at its deadline or once the features would exceed --max-feature-gb; one teacher-forced target
   forward per sequence captures the drafter's target layers. Held-out data is split by prompt.
2. Training: random anchors inside each response; block = [token at anchor, MASK x (B-1)] at
   positions anchor .. anchor+B-1, context = features of positions < anchor; several blocks per
   sequence, kept apart by the mask; cross-entropy weighted exp(-(j-1)/gamma) at block position j;
   AdamW, bf16 autocast on CUDA, checkpoints every --ckpt-every steps and at the end (the objective:
   train/objective.py; held-out evaluation: train/evaluate.py).
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
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from verispec.models.qwen2 import CausalLM
from verispec.spec_decode.dflash import save_drafter
from verispec.spec_decode.dflash_model import DFlashConfig, DFlashDrafter, new_config
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
from verispec.train.evaluate import evaluate
from verispec.train.objective import dflash_loss, make_batch
from verispec.train.options import TrainOptions
from verispec.train.prompts import STYLES, mine_functions, render_styled, source_roots


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
