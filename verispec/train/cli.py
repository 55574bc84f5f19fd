"""`verispec train-drafter`: its flags (from TrainOptions) and the command, which builds the target's engine
and runs the training pipeline (train/loop.py)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from verispec.config import EngineConfig
from verispec.train.options import TrainOptions
from verispec.train.prompts import STYLES

# (flag, type, help) of the numeric TrainOptions.
_NUMERIC_FLAGS: list[tuple[str, type, str]] = [
    ("minutes", float, "wall-clock budget of the whole run (generation + training)"),
    ("num-prompts", int, "prompts to mine from the prompt sources"),
    ("max-new-tokens", int, "tokens the target generates per response"),
    ("block-size", int, "the drafter's block: tokens drafted per step"),
    ("layers", int, "drafter transformer layers"),
    ("seed", int, "seed of prompt mining, sampling, the split and training"),
    ("gen-fraction", float, "fraction of --minutes spent generating responses with the target"),
    ("target-layers", int, "how many of the target's layers the drafter reads hidden states from"),
    ("batch-seqs", int, "sequences per training batch"),
    ("anchors", int, "blocks (anchor positions in the response) sampled per training sequence"),
    ("lr", float, "peak learning rate"),
    ("ckpt-every", int, "training steps between checkpoints"),
    ("max-steps", int, "stop after this many training steps (None: when the time budget ends)"),
    ("max-epochs", float, "stop after this many passes over the training sequences (0: no cap); more only "
                          "memorizes them"),
    ("val-every", int, "training steps between validation losses; the drafter saved is the one with the "
                       "lowest (0: the last)"),
    ("temperature", float, "sampling temperature of each prompt's first response (0: greedy)"),
    ("max-num-seqs", int, "the target engine's max_num_seqs while generating"),
    ("max-prompt-tokens", int, "prompts longer than this are skipped"),
    ("warmup", int, "learning-rate warm-up steps"),
    ("val-fraction", float, "fraction of prompts held out for validation"),
    ("max-val-prompts", int, "most validation prompts"),
    ("max-feature-gb", float, "most memory the target's stored features may take"),
    ("feature-batch-tokens", int, "tokens per target forward while extracting features"),
    ("responses-per-prompt", int, "responses generated per prompt (the extra ones at --extra-temperature)"),
    ("extra-temperature", float, "sampling temperature of the extra responses"),
    ("refill-below", float, "add generation jobs when at most this fraction of max_num_seqs runs"),
    ("max-stub-chars", int, "longest mined function stub, in characters"),
    ("log-every", int, "training steps between log lines"),
    ("magpie-share", float, "share of --num-prompts that are Magpie requests when mixed with stub sources"),
    ("magpie-fraction", float, "most of the generation budget the Magpie first user turns may take"),
    ("magpie-temperature", float, "sampling temperature of the Magpie user turns"),
    ("magpie-top-p", float, "top-p of the Magpie user turns"),
    ("magpie-max-tokens", int, "longest Magpie user turn, in tokens (longer ones are dropped)"),
    ("multi-turn", float, "share of the Magpie conversations that get a second user turn"),
    ("stop-after-steps", int, "end this invocation after this many training steps (resume with --resume)"),
    ("stop-after-minutes", float, "end this invocation after this many minutes (resume with --resume)"),
    ("state-shard-mib", float, "largest file of OUT/train_state/, in MiB"),
]


def _default(name: str):
    return TrainOptions.__dataclass_fields__[name].default


def add_train_parser(sub) -> None:
    """Register `verispec train-drafter` on the CLI's subparsers."""
    s = sub.add_parser("train-drafter", help="train a DFlash drafter for a target model",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--target", required=True, help="registry name or path of the target model")
    s.add_argument("--out", required=True, help="directory for model.safetensors, config.json, train_log.json")
    for name, typ, text in _NUMERIC_FLAGS:
        s.add_argument(f"--{name}", type=typ, default=_default(name.replace("-", "_")), help=text)
    s.add_argument("--prompt-sources", default=_default("prompt_sources"),
                   help="comma-separated: magpie (user requests the target writes itself, train/magpie.py), "
                        "stdlib and/or installed packages by import name (numpy,scipy,...: docstring stubs); "
                        "with magpie and stub sources, --magpie-share of --num-prompts are Magpie requests")
    s.add_argument("--exclude-prompts", default="",
                   help="comma-separated prompt files (JSONL 'prompt' or lines) kept out of the Magpie requests, "
                        "beside prompts/heldout_requests.jsonl and HumanEval")
    s.add_argument("--magpie-keep-incomplete", action="store_true",
                   help="keep user turns cut at --magpie-max-tokens (tests with random weights)")
    s.add_argument("--state-dtype", default=_default("state_dtype"), choices=["float32", "bfloat16"],
                   help="AdamW moments in OUT/train_state (float32: exact resume; weights are float32 always)")
    s.add_argument("--prompt-styles", default=_default("prompt_styles"),
                   help=f"comma-separated, cycled over the prompts ({', '.join(STYLES)}; repeat one to weight it)")
    s.add_argument("--device", default=_default("device"), help="cpu, cuda, cuda:N or auto (the target's engine)")
    s.add_argument("--save-dtype", default=_default("save_dtype"), choices=["bfloat16", "float32"],
                   help="dtype of the saved drafter weights")
    s.add_argument("--sequences", default=None, help="JSONL of (prompt, response) ids from an earlier run")
    s.add_argument("--generate-only", action="store_true", help="stop after writing OUT/sequences.jsonl")
    s.add_argument("--resume", action="store_true",
                   help="continue from OUT/train_state (and OUT/sequences.jsonl when --sequences is not given)")
    s.add_argument("--save-state", action="store_true",
                   help="write OUT/train_state/ (for --resume) at every checkpoint and at the end, in shards of "
                        "--state-shard-mib MiB")
    s.set_defaults(func=cmd_train_drafter)


def cmd_train_drafter(args, engine_factory: Callable | None = None) -> int:
    """Train as the parsed flags say. engine_factory(TrainOptions) -> LLMEngine builds the target's engine
    (default: load_engine; tests pass a tiny model's)."""
    from verispec.train.loop import train

    fields = set(TrainOptions.__dataclass_fields__)
    opts = TrainOptions(**{k: v for k, v in vars(args).items() if k in fields})
    engine = (engine_factory or load_engine)(opts)
    train(engine, opts)
    return 0


def load_engine(opts: TrainOptions):
    """The target's engine, sized for generating the training data (with --sequences: no cache, no graphs)."""
    from verispec.entrypoints.llm import LLM

    block = EngineConfig.block_size  # the engine's default block size
    max_len = opts.max_prompt_tokens + opts.max_new_tokens + 32
    serve = opts.sequences is None  # with --sequences the engine never generates: no cache, no graphs
    blocks = opts.max_num_seqs * -(-max_len // block) + 64 if serve else -(-max_len // block) + 8
    llm = LLM(opts.target, device=opts.device, max_model_len=max_len, max_num_seqs=opts.max_num_seqs,
              num_gpu_blocks=blocks, seed=opts.seed, max_num_batched_tokens=8192, enforce_eager=not serve)
    return llm.engine
