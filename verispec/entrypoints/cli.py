"""The `verispec` command: pull, models, generate, serve, bench, train-drafter."""

from __future__ import annotations

import argparse
import sys
import time

from verispec.core.version import __version__
from verispec.entrypoints.args import (
    GENERATE_PROMPT,
    HelpFormatter,
    Parser,
    add_generate_args,
    add_serve_args,
    engine_config_from_args,
    sampling_params_from_args,
)


def cmd_pull(args) -> int:
    from verispec.loader.registry import pull

    path = pull(args.name, progress=True, force=args.force)
    print(path)
    return 0


def cmd_models(args) -> int:
    from verispec.loader.registry import list_models

    rows = list_models()
    print(f"{'name':32} {'size':>10}  {'local':6} description")
    for m in rows:
        size = f"{m['size'] / 2**20:.0f} MiB" if m.get("size") else "?"
        local = "yes" if m.get("path") else "no"
        star = " (default)" if m.get("default") else ""
        refused = "" if m.get("runs", True) else f" [not runnable: verispec does not run {m['architecture']!r}]"
        print(f"{m['name']:32} {size:>10}  {local:6} {m['description']}{star}{refused}")
    return 0


def cmd_generate(args) -> int:
    config = engine_config_from_args(args, "generate")  # checked before the (slow) imports and the load
    params = sampling_params_from_args(args)
    from verispec.entrypoints.llm import LLM
    from verispec.entrypoints.stream import stream_one

    prompt = args.prompt if args.prompt is not None else (sys.stdin.read() if not sys.stdin.isatty() else GENERATE_PROMPT)
    llm = LLM(**config.as_kwargs())
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    stats = stream_one(llm.engine, prompt, params, sys.stdout)
    m = llm.get_metrics()
    print(file=sys.stderr)
    print(
        f"[verispec] prompt {stats['prompt_tokens']} tok in {stats['ttft']:.2f}s "
        f"({stats['prompt_tokens'] / max(stats['ttft'], 1e-9):.1f} tok/s); "
        f"decode {stats['decode_tokens']} tok in {stats['decode_time']:.2f}s "
        f"({stats['decode_tokens'] / max(stats['decode_time'], 1e-9):.1f} tok/s); finish: {stats['finish_reason']}",
        file=sys.stderr,
    )
    if m["spec_decode_num_drafts"]:
        rate = m["spec_decode_num_accepted_tokens"] / max(m["spec_decode_num_draft_tokens"], 1)
        per = m["spec_decode_num_accepted_tokens_per_pos"]
        print(
            f"[verispec] speculative: {m['spec_decode_num_drafts']} drafts, acceptance {rate:.1%}, "
            f"mean acceptance length {m['spec_decode_mean_acceptance_length']:.2f}, "
            f"accepted per position {per}",
            file=sys.stderr,
        )
    return 0


def cmd_serve(args) -> int:
    from verispec.entrypoints.server import main as serve_main

    return serve_main(args)


def cmd_bench(args) -> int:
    from verispec.bench.main import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="verispec", description="fast, verifiable speculative decoding")
    p.add_argument("--version", action="version", version=f"verispec {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("pull", help="fetch and verify a registry model", formatter_class=HelpFormatter)
    s.add_argument("name", help="a registry name (see `verispec models`)")
    s.add_argument("--force", action="store_true", help="download and verify again even when it is local")
    s.set_defaults(func=cmd_pull)

    s = sub.add_parser("models", help="list registry models and what is local")
    s.set_defaults(func=cmd_models)

    s = sub.add_parser("generate", help="generate text for one prompt, streamed", formatter_class=HelpFormatter)
    add_generate_args(s)
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=HelpFormatter)
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)

    from verispec.bench.main import add_bench_parser

    add_bench_parser(sub)
    from verispec.train.cli import add_train_parser

    add_train_parser(sub)
    return p


def dispatch(args: argparse.Namespace, func=None) -> int:
    """Run a parsed command (func: instead of args.func); a ValueError or a missing file is a one-line
    error with exit status 2, Ctrl-C exit status 130."""
    t0 = time.monotonic()
    try:
        return (func or args.func)(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"verispec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nverispec: interrupted after {time.monotonic() - t0:.1f}s", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    return dispatch(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
