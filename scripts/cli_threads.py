"""Run the verispec command line with torch limited to N threads (a loaded machine: see BENCHMARKS session 10).

usage: PYTHONPATH=$PWD python3 scripts/cli_threads.py N generate "def fibonacci(n):" --device cpu
"""

from __future__ import annotations

import sys

import torch

if __name__ == "__main__":
    torch.set_num_threads(int(sys.argv.pop(1)))
    from verispec.entrypoints.cli import main

    sys.exit(main())
