"""Start-up time to the first token: imports, LLM() (weights from the dequantized cache, tokenizer,
model, KV cache, graphs), the first token (a one-token generate), then a 16-token generate (which
captures the decode graph lazily); each phase's seconds.

    python3 scripts/startup_probe.py [MODEL] [graph_capture: lazy|all]
"""

from __future__ import annotations

import sys
import time

T0 = time.perf_counter()

from verispec import LLM, SamplingParams  # noqa: E402

LLM  # noqa: B018 - the lazy attribute: imports torch and the engine


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b-instruct"
    capture = sys.argv[2] if len(sys.argv) > 2 else "lazy"
    t_import = time.perf_counter()
    llm = LLM(model, max_model_len=4096, graph_capture=capture)
    t_load = time.perf_counter()
    llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0.0, max_tokens=1))
    t_first = time.perf_counter()
    llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    t_16 = time.perf_counter()
    print(f"imports {t_import - T0:.2f}s  LLM() {t_load - t_import:.2f}s  first token {t_first - t_load:.2f}s"
          f"  -> LLM() to first token {t_first - t_import:.2f}s, process start to first token {t_first - T0:.2f}s;"
          f"  then generate(16 tokens) {t_16 - t_first:.2f}s  ({capture} capture)")


if __name__ == "__main__":
    main()
