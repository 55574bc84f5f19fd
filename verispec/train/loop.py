"""The DFlash training pipeline behind `verispec train-drafter` (train/cli.py): a drafter for a target model,
from nothing but the target.

1. Data (train/magpie.py, train/prompts.py, train/data.py). --prompt-sources "magpie" has the instruct
   target write user requests itself (its chat template's user-turn prefix, sampled to the end of the
   turn; filtered against the held-out sets and near duplicates; --multi-turn of them get a second user
   turn); stdlib and package names mine docstring stubs, rendered in --prompt-styles. With both,
   --magpie-share of --num-prompts are Magpie requests. The target answers each through verispec
   (response 0 at --temperature, greedy by default; --responses-per-prompt - 1 extra sampled ones);
   generation stops at its deadline or once the features would exceed --max-feature-gb; one teacher-
   forced target forward per sequence captures the drafter's target layers. Held-out data is split by
   prompt (a conversation's turns stay together).
2. Training: random anchors inside each response; block = [token at anchor, MASK x (B-1)] at
   positions anchor .. anchor+B-1, context = features of positions < anchor; several blocks per
   sequence, kept apart by the mask; cross-entropy weighted exp(-(j-1)/gamma) at block position j;
   AdamW, bf16 autocast on CUDA, checkpoints every --ckpt-every steps and at the end (the objective:
   train/objective.py; held-out evaluation: train/evaluate.py).
The time budget (--minutes) covers everything after the target is loaded (mining included);
generation gets at most --gen-fraction of it; the learning rate follows a cosine over the time left
for training (over the steps with --max-steps).

Runs can be split, also across machines: --generate-only writes OUT/sequences.jsonl; --sequences FILE
(.jsonl or .jsonl.gz) skips generation; --save-state writes OUT/train_state/ (train/state.py: shards
of --state-shard-mib MiB, 15 by default so each file fits a 16 MiB transfer); --stop-after-minutes /
--stop-after-steps end an invocation early; --resume continues from OUT/train_state and reuses
OUT/sequences.jsonl. The resumed run spends what is left of --minutes (the time used is saved) and
re-extracts the features (deterministic); with --max-steps and float32 state it ends with exactly the
weights of an uninterrupted run (the batches' generator, AdamW's moments and the step-based schedule
are restored). Without --max-steps the cosine follows wall time, so a resumed run is close, not equal.

Training stops at --max-epochs passes over the training sequences (10: session 10's run made 63 passes
over 5,675 sequences and memorized them: training loss 0.07, validation loss 6.37), and the drafter saved
is the one with the lowest validation loss, checked every --val-every steps (BestWeights; within one
invocation: a resumed run compares its own checks only).

Default run on one H200 (`verispec train-drafter --target qwen2.5-coder-1.5b-instruct --out DIR`,
15 minutes after the target loads). Session 10 measured generation at 5.8k tok/s: every sampled row
(Magpie turns at temperature 1, extra responses at 0.7) cost its own kernels; they are now drawn together
(worker/verifier.py); session 11 measured 11.7k tok/s (2x; the prediction was ~25k), the Magpie phase
slowest (it refilled a slot every step, so its steps prefilled and ran eagerly: now it refills in bursts
as the response phases do, --refill-below; not measured yet). Planned shares: generation <= 450 s (0.5), of it at
most 25% for 8,000 Magpie first turns of <= 320 tokens, 2,000 stdlib stubs, 10,000 first responses
<= 256 tokens, ~2,000 second turns, sampled extras until the 80 GiB feature cap (~5.6M tokens at
5 layers x 1536 x bf16; ~18k sequences) stops it; features ~40 s; training until the epoch cap (~5,600
steps at batch 32, ~300 s) or the budget. Files: sequences.jsonl ~40 MB (gzip ~15 MB), model.safetensors
211 MB (bf16), train_state/ 1.26 GB (float32; 0.84 GB with --state-dtype bfloat16).
The GPU commands (the 15 minutes split over two <= 10-minute calls, then the held-out measurement):
scripts/gpu_train_dflash.sh.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from verispec.models.qwen2 import CausalLM
from verispec.spec_decode.dflash import save_drafter
from verispec.spec_decode.dflash_model import DFlashConfig, DFlashDrafter, new_config
from verispec.train.data import (
    GenJob,
    Sample,
    Seq,
    extract_features,
    generate,
    job_seed,
    load_sequences,
    make_jobs,
    pick_mask_token,
    save_sequences,
)
from verispec.train.evaluate import evaluate
from verispec.train.magpie import (
    MagpieOptions,
    Request,
    chat_ids,
    first_requests,
    make_filter,
    sample_seed,
    second_requests,
)
from verispec.train.objective import dflash_loss, make_batch
from verispec.train.options import TrainOptions
from verispec.train.prompts import STYLES, mine_functions, render_styled, source_roots
from verispec.train.state import load_state, read_meta, save_state

STATE_DIR = "train_state"


def build_prompts(tokenizer, opts: TrainOptions, sources: list[str] | None = None,
                  limit: int | None = None) -> list[list[int]]:
    """Prompt ids: stubs mined from `sources` (default: --prompt-sources less magpie) in the chosen styles, at
    most max_prompt_tokens long."""
    sources = [s for s in _csv(opts.prompt_sources) if s != "magpie"] if sources is None else sources
    limit = opts.num_prompts if limit is None else limit
    styles = _csv(opts.prompt_styles)
    if bad := [s for s in styles if s not in STYLES]:
        raise ValueError(f"unknown prompt styles {bad} (choose from {', '.join(STYLES)})")
    present = []
    for src in sources:
        try:
            source_roots(src)
            present.append(src)
        except (ValueError, ImportError):
            print(f"prompt source {src!r} is not installed here: skipped")
    if not present or limit <= 0:
        return []
    stubs = mine_functions(present, limit, opts.seed, opts.max_stub_chars)
    texts = render_styled(tokenizer, stubs, styles)
    ids = tokenizer.encode_batch(texts) if hasattr(tokenizer, "encode_batch") else [tokenizer.encode(t) for t in texts]
    kept = [p for p in ids if len(p) <= opts.max_prompt_tokens]
    print(f"{len(kept)} stub prompts ({len(stubs)} stubs from {', '.join(present)}; styles {', '.join(styles)})")
    return kept


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def feature_bytes_per_token(cfg: DFlashConfig, dev: torch.device) -> int:
    return len(cfg.target_layers) * cfg.hidden_size * (2 if dev.type == "cuda" else 4)


def magpie_options(opts: TrainOptions) -> MagpieOptions:
    """The Magpie sampling and filter settings of a run."""
    return MagpieOptions(temperature=opts.magpie_temperature, top_p=opts.magpie_top_p,
                         max_tokens=opts.magpie_max_tokens, keep_incomplete=opts.magpie_keep_incomplete,
                         refill_below=opts.refill_below)


def source_counts(opts: TrainOptions) -> tuple[int, int]:
    """(Magpie requests, stub prompts) wanted: all of --num-prompts for the one kind present, else
    --magpie-share of them Magpie requests."""
    sources = _csv(opts.prompt_sources)
    stubs = [s for s in sources if s != "magpie"]
    if "magpie" not in sources:
        return 0, opts.num_prompts
    n = opts.num_prompts if not stubs else round(opts.num_prompts * opts.magpie_share)
    return n, opts.num_prompts - n


def make_sequences(engine, opts: TrainOptions, cfg: DFlashConfig, deadline: float,
                   out: Path | None = None) -> tuple[list[Seq], int]:
    """Build the prompts and generate (at most what fits in max_feature_gb); (sequences, number of prompts).

    Phases, each within the generation deadline: (1) Magpie first user turns (at most --magpie-fraction of
    the time); (2) every prompt's first response at --temperature, Magpie requests and stub prompts
    interleaved (seeded), so a cut keeps the mix; (3) a second user turn for --multi-turn of the Magpie
    conversations, from the first exchange; (4) the second turns' responses and the extra sampled responses
    (--responses-per-prompt). Requests go to OUT/requests.jsonl for inspection."""
    tok, t = engine.tokenizer, time.monotonic()
    span = max(0.0, deadline - t)
    n_magpie, n_stub = source_counts(opts)
    mo = magpie_options(opts)
    filt = make_filter(max(1, n_magpie), mo, _csv(opts.exclude_prompts))
    requests = first_requests(engine, n_magpie, opts.seed, t + span * opts.magpie_fraction, mo, filt) if n_magpie else []
    if n_magpie:
        print(f"{len(requests)} Magpie requests kept of {n_magpie} wanted ({filt.stats})")
    items: list[tuple[list[int], Request | None]] = []
    for r in requests:
        ids = chat_ids(tok, r.system, [{"role": "user", "content": r.text}])
        if len(ids) <= opts.max_prompt_tokens:
            items.append((ids, r))
    items += [(p, None) for p in build_prompts(tok, opts, limit=n_stub)]
    random.Random(opts.seed).shuffle(items)
    prompts = [p for p, _ in items]
    dev = engine.parts.model.lm_head_weight.device
    cap = int(opts.max_feature_gb * 2**30 / feature_bytes_per_token(cfg, dev))
    later = opts.multi_turn > 0 and n_magpie > 0 or opts.responses_per_prompt > 1
    now = time.monotonic()
    first = make_jobs(prompts, 1, opts.temperature, opts.extra_temperature, opts.seed)
    seqs = generate(engine, first, opts.max_new_tokens, now + (deadline - now) * (0.7 if later else 1.0),
                    opts.refill_below, cap)
    rows = [{"group": g, "turn": 1, "system": r.system, "text": r.text} for g, (_, r) in enumerate(items) if r]
    jobs2: list[GenJob] = []
    if opts.multi_turn > 0 and time.monotonic() < deadline:
        answered = {q.group: q for q in seqs}
        chosen = [g for g, (_, r) in enumerate(items) if r is not None and g in answered
                  and sample_seed(opts.seed, "multi", g) % 10_000 < opts.multi_turn * 10_000]
        eos = set(getattr(tok, "eos_token_ids", ()) or ())
        exch = [(items[g][1], tok.decode([x for x in answered[g].response if x not in eos])) for g in chosen]
        now = time.monotonic()
        for i, r2 in second_requests(engine, exch, opts.seed, now + (deadline - now) * 0.3, mo, filt):
            g, (r1, a1) = chosen[i], exch[i]
            ids = chat_ids(tok, r1.system, [{"role": "user", "content": r1.text}, {"role": "assistant", "content": a1},
                                            {"role": "user", "content": r2.text}])
            if len(ids) <= opts.max_prompt_tokens:
                jobs2.append(GenJob(ids, g, opts.temperature, job_seed(opts.seed, g, 1000) if opts.temperature else None))
                rows.append({"group": g, "turn": 2, "system": r2.system, "text": r2.text})
        print(f"{len(jobs2)} second user turns of {len(chosen)} conversations")
    extra = make_jobs(prompts, opts.responses_per_prompt, opts.temperature, opts.extra_temperature,
                      opts.seed)[len(prompts):]
    if (jobs2 or extra) and time.monotonic() < deadline:
        left = cap - sum(len(q.prompt) + len(q.response) for q in seqs)
        seqs += generate(engine, jobs2 + extra, opts.max_new_tokens, deadline, opts.refill_below, max(0, left))
    if out is not None:
        with open(out / "requests.jsonl", "w") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
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


def lr_at(opts: TrainOptions, step: int, frac: float) -> float:
    """Linear warm-up over opts.warmup steps (global steps: a resumed run continues it), then a cosine from
    lr to lr / 10 over the schedule's progress frac (0 .. 1)."""
    warm = min(1.0, (step + 1) / max(1, opts.warmup))
    return opts.lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))


@dataclass
class Progress:
    """Where a run stands across invocations (saved in the training state's meta)."""

    step: int = 0
    seconds_used: float = 0.0  # of the --minutes budget, by earlier invocations
    train_seconds: float = 0.0  # training time of earlier invocations
    ema: float | None = None


def schedule_frac(opts: TrainOptions, step: int, train_seconds: float, train_total: float,
                  step_cap: int | None = None) -> float:
    """The cosine's progress: step / --max-steps when that is set (deterministic, so a resumed run repeats an
    uninterrupted one exactly), else the training time spent over the training time of the budget, or the
    steps over the --max-epochs cap when that comes first."""
    if opts.max_steps:
        return step / opts.max_steps
    frac = train_seconds / max(train_total, 1e-6)
    return max(frac, step / step_cap) if step_cap else frac


def epoch_cap(opts: TrainOptions, num_train: int) -> int | None:
    """The step at which --max-epochs passes over num_train sequences are done (None: no cap)."""
    if opts.max_epochs <= 0:
        return None
    return max(1, math.ceil(opts.max_epochs * num_train / opts.batch_seqs))


@dataclass
class BestWeights:
    """The drafter's weights at its lowest validation loss so far (a device copy), checked every --val-every
    steps on a fixed draw of anchors over at most 4 batches of the validation sequences."""

    val: list[Sample]
    opts: TrainOptions
    loss: float = math.inf
    step: int = -1
    state: dict | None = None
    curve: list | None = None

    def check(self, drafter: DFlashDrafter, target: CausalLM, step: int) -> float:
        """Validation loss now; keeps a copy of the weights when it is the lowest."""
        loss = quick_val_loss(drafter, target, self.val[: 4 * self.opts.batch_seqs], self.opts)
        self.curve = (self.curve or []) + [[step, round(loss, 4)]]
        if loss < self.loss:
            self.loss, self.step = loss, step
            self.state = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
        return loss

    def restore(self, drafter: DFlashDrafter) -> bool:
        """Load the best weights into drafter; False when there are none."""
        if self.state is None:
            return False
        drafter.load_state_dict(self.state)
        return True


@torch.no_grad()
def quick_val_loss(drafter: DFlashDrafter, target: CausalLM, val: list[Sample], opts: TrainOptions) -> float:
    """The block loss over val at anchors drawn from a fixed seed (the same anchors at every check)."""
    was = drafter.training
    drafter.eval()
    gen = torch.Generator().manual_seed(4321)
    dev = target.lm_head_weight.device
    total = 0.0
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        for i in range(0, len(val), opts.batch_seqs):
            part = val[i : i + opts.batch_seqs]
            loss, _ = dflash_loss(drafter, target, make_batch(part, opts.anchors, drafter.config, gen), with_stats=False)
            total += loss.item() * len(part)
    drafter.train(was)
    return total / max(1, len(val))


def sequences_path(opts: TrainOptions, out: Path) -> Path | None:
    """--sequences, or with --resume the run's own OUT/sequences.jsonl when it exists (no generation again)."""
    if opts.sequences:
        return Path(opts.sequences)
    own = out / "sequences.jsonl"
    return own if opts.resume and own.is_file() else None


def train(engine, opts: TrainOptions) -> dict:
    """The whole pipeline against an already built engine (its model is the target)."""
    t0 = time.monotonic()
    torch.manual_seed(opts.seed)
    target: CausalLM = engine.parts.model
    dev = target.lm_head_weight.device
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    mask_id = pick_mask_token(engine.tokenizer, target.config.vocab_size)
    cfg = new_config(target, opts.target, mask_id, opts.block_size, opts.layers, opts.target_layers)
    fp = cfg.target_fingerprint["sha256"]
    meta = read_meta(out / STATE_DIR) if opts.resume else None
    if opts.resume and meta is None:
        print(f"--resume: no state in {out / STATE_DIR}; starting from step 0")
    if meta is not None and meta.get("target_fingerprint") != fp:
        raise ValueError(f"the state in {str(out / STATE_DIR)!r} was trained for another target model")
    prior = Progress(**{k: v for k, v in (meta or {}).get("progress", {}).items() if k in Progress.__dataclass_fields__})
    budget = max(0.0, opts.minutes * 60 - prior.seconds_used)
    seq_file = sequences_path(opts, out)
    if seq_file is not None:
        seqs, n_prompts = load_sequences(seq_file, fp), 0
        print(f"{len(seqs)} sequences read from {seq_file}")
    else:
        deadline = t0 + budget * (1.0 if opts.generate_only else opts.gen_fraction)
        seqs, n_prompts = make_sequences(engine, opts, cfg, deadline, out)
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
    gen = torch.Generator().manual_seed(opts.seed)  # the training batches' draws
    if meta is not None:
        load_state(out / STATE_DIR, drafter, optim, gen)
        print(f"resumed from {out / STATE_DIR} at step {prior.step}")
    t_train0 = time.monotonic()
    reserve = min(30.0, budget * 0.05)  # evaluation and saving
    end = t0 + budget - reserve
    stop = end if opts.stop_after_minutes is None else min(end, t0 + opts.stop_after_minutes * 60 - reserve)
    clock = TrainClock(t0, t_train0, prior, prior.train_seconds + max(end - t_train0, 1e-6), stop)
    best = BestWeights(val, opts)
    step, ema, stats = train_loop(drafter, target, optim, gen, tr, opts, clock, out, fp, best)
    last_val = best.check(drafter, target, step) if opts.val_every > 0 else None
    state_bytes = _save_state(drafter, optim, gen, opts, out, fp, clock.progress(step, ema))
    kept = best.step if opts.val_every > 0 and best.restore(drafter) else step  # the lowest validation loss
    val_loss, val_stats = evaluate(drafter, target, val, opts, cfg)
    sha = save_drafter(drafter, out, getattr(torch, opts.save_dtype))
    cap = epoch_cap(opts, len(tr))
    complete = ((opts.max_steps is not None and step >= opts.max_steps) or (cap is not None and step >= cap)
                or time.monotonic() >= end)
    log = dict(
        target=opts.target, target_fingerprint=fp, mask_token_id=mask_id, target_layers=cfg.target_layers,
        num_prompts=n_prompts, num_sequences=len(samples), num_train_sequences=len(tr),
        num_val_sequences=len(val), num_tokens=sum(s.tokens.numel() for s in samples),
        num_response_tokens=sum(s.tokens.numel() - s.prompt_len for s in samples),
        num_greedy_sequences=sum(s.greedy for s in samples), feature_budget_gb=round(gb, 1),
        seconds_generate=round(t_gen, 1), seconds_features=round(t_feat, 1),
        seconds_train=round(time.monotonic() - t_train0, 1), minutes_total=round((time.monotonic() - t0) / 60, 2),
        minutes_budget_used=round(clock.progress(step, ema).seconds_used / 60, 2),
        steps=step, resumed_from_step=prior.step, complete=complete, state_bytes=state_bytes,
        epochs=round(step * opts.batch_seqs / max(1, len(tr)), 2), epoch_cap_steps=cap, saved_step=kept,
        best_val_loss=None if best.state is None else round(best.loss, 4), last_val_loss=last_val,
        val_curve=best.curve,
        final_loss=ema, final_train_tau_uniform=stats.get("tau_uniform"),
        val_loss=val_loss, val=val_stats, weights_sha256=sha, options=asdict(opts),
    )
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(f"drafter saved to {out}: model.safetensors sha256 {sha}")
    print(f"val loss {val_loss:.3f}, val tau {val_stats['tau']:.2f} (the engine's greedy acceptance length on "
          f"held-out responses; first 128 tokens {val_stats['tau_first128']:.2f}; uniform-anchor estimate "
          f"{val_stats['tau_uniform']:.2f}), {step} steps, {log['minutes_total']} min"
          + ("" if complete else "; stopped early: continue with --resume"))
    return log


@dataclass
class TrainClock:
    """The times one invocation trains by: its start, the run's progress before it, the training time of the
    whole budget (the cosine's length) and when this invocation stops."""

    t0: float
    t_train0: float
    prior: Progress
    train_total: float
    stop: float

    def train_seconds(self) -> float:
        return self.prior.train_seconds + time.monotonic() - self.t_train0

    def progress(self, step: int, ema: float | None) -> Progress:
        return Progress(step, self.prior.seconds_used + time.monotonic() - self.t0, self.train_seconds(), ema)


def train_loop(drafter: DFlashDrafter, target: CausalLM, optim, gen: torch.Generator, tr: list[Sample],
               opts: TrainOptions, clock: TrainClock, out: Path, fp: str,
               best: BestWeights | None = None) -> tuple[int, float | None, dict]:
    """AdamW steps from clock.prior.step until clock.stop, --max-steps, the --max-epochs cap or
    --stop-after-steps more steps (at least one); the host syncs only every log_every steps. Batches are
    drawn from `gen`; every --val-every steps `best` checks the validation loss."""
    dev, cfg = target.lm_head_weight.device, drafter.config
    step0 = clock.prior.step
    step, ema, stats = step0, clock.prior.ema, {}
    cap = epoch_cap(opts, len(tr))
    last = min(x for x in (opts.max_steps, None if opts.stop_after_steps is None else step0 + opts.stop_after_steps,
                           cap, 1 << 62) if x is not None)
    bar = tqdm(desc="training", unit="step", total=opts.max_steps, initial=step0)
    while step < last and (step == step0 or time.monotonic() < clock.stop):
        lr = lr_at(opts, step, schedule_frac(opts, step, clock.train_seconds(), clock.train_total, cap))
        for g in optim.param_groups:
            g["lr"] = lr
        batch = make_batch([tr[i] for i in torch.randint(len(tr), (opts.batch_seqs,), generator=gen)],
                           opts.anchors, cfg, gen)
        log = (step + 1) % opts.log_every == 0 or step == 0
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
        if best is not None and opts.val_every and step % opts.val_every == 0 and step < last:
            bar.set_postfix(loss=f"{ema:.3f}", val=f"{best.check(drafter, target, step):.3f}", lr=f"{lr:.1e}")
        if opts.ckpt_every and step % opts.ckpt_every == 0 and step < last:
            _checkpoint(drafter, optim, gen, opts, out, fp, clock.progress(step, ema))
    bar.close()
    return step, ema, stats


def _checkpoint(drafter: DFlashDrafter, optim, gen: torch.Generator, opts: TrainOptions, out: Path, fp: str,
                progress: Progress) -> tuple[str, int | None]:
    """The servable drafter (--save-dtype); with --save-state also OUT/train_state (train/state.py).
    Returns (model.safetensors sha256, the state's bytes or None)."""
    size = _save_state(drafter, optim, gen, opts, out, fp, progress)
    return save_drafter(drafter, out, getattr(torch, opts.save_dtype)), size


def _save_state(drafter: DFlashDrafter, optim, gen: torch.Generator, opts: TrainOptions, out: Path, fp: str,
                progress: Progress) -> int | None:
    """With --save-state, OUT/train_state (the current weights, for --resume); its bytes, else None."""
    if not opts.save_state:
        return None
    meta = {"target_fingerprint": fp, "progress": asdict(progress)}
    return save_state(out / STATE_DIR, drafter, optim, gen, meta, getattr(torch, opts.state_dtype),
                      opts.state_shard_mib)
