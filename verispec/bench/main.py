"""`verispec bench latency|throughput|serve|spec`."""

from __future__ import annotations

import argparse


def add_bench_parser(sub) -> None:
    s = sub.add_parser("bench", help="benchmarks: latency, throughput, serve, spec")
    s.add_argument("kind", choices=["latency", "throughput", "serve", "spec"])
    s.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    s.add_argument("--device", default="auto")
    s.add_argument("--dtype", default="auto")
    s.add_argument("--json", default=None, help="write the numbers to this file")
    s.add_argument("--rest", nargs=argparse.REMAINDER, default=[])
    s.set_defaults(func=lambda a: main(a))


def main(args) -> int:
    raise SystemExit(f"verispec bench {args.kind}: not built yet")
