"""`verispec train-drafter`: its flags (from TrainOptions) and the command, which builds the target's engine
and runs the training pipeline (train/loop.py)."""

from __future__ import annotations

from collections.abc import Callable

from verispec.config import EngineConfig
from verispec.train.options import TrainOptions
from verispec.train.prompts import STYLES


def _default(name: str):
    return TrainOptions.__dataclass_fields__[name].default


def add_train_parser(sub) -> None:
    """Register `verispec train-drafter` on the CLI's subparsers."""
    s = sub.add_parser("train-drafter", help="train a DFlash drafter for a target model")
    s.add_argument("--target", required=True, help="registry name or path of the target model")
    s.add_argument("--out", required=True, help="directory for model.safetensors, config.json, train_log.json")
    for name, typ in [("minutes", float), ("num-prompts", int), ("max-new-tokens", int), ("block-size", int),
                      ("layers", int), ("seed", int), ("gen-fraction", float), ("target-layers", int),
                      ("batch-seqs", int), ("anchors", int), ("lr", float), ("ckpt-every", int),
                      ("max-steps", int), ("temperature", float), ("max-num-seqs", int), ("max-prompt-tokens", int),
                      ("warmup", int), ("val-fraction", float), ("max-val-prompts", int), ("max-feature-gb", float),
                      ("feature-batch-tokens", int), ("responses-per-prompt", int), ("extra-temperature", float),
                      ("refill-below", float), ("max-stub-chars", int), ("log-every", int),
                      ("magpie-share", float), ("magpie-fraction", float), ("magpie-temperature", float),
                      ("magpie-top-p", float), ("magpie-max-tokens", int), ("multi-turn", float),
                      ("stop-after-steps", int), ("stop-after-minutes", float), ("state-shard-mib", float)]:
        s.add_argument(f"--{name}", type=typ, default=_default(name.replace("-", "_")))
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
    s.add_argument("--device", default=_default("device"))
    s.add_argument("--save-dtype", default=_default("save_dtype"), choices=["bfloat16", "float32"])
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
