"""Stream one request's text to a file as it is generated (used by `verispec generate`)."""

from __future__ import annotations

import time
from typing import TextIO

from verispec.sampling_params import SamplingParams


def stream_one(engine, prompt: str, params: SamplingParams, out: TextIO) -> dict:
    """Run one request to completion, writing text deltas as they arrive. Returns timings."""
    t0 = time.monotonic()
    engine.add_request("cli-0", prompt, params)
    printed = 0
    t_first = None
    final = None
    while engine.has_unfinished_requests():
        for ro in engine.step():
            c = ro.outputs[0]
            if c.token_ids and t_first is None:
                t_first = time.monotonic()
            out.write(c.text[printed:])
            out.flush()
            printed = len(c.text)
            if ro.finished:
                final = ro
    t_end = time.monotonic()
    t_first = t_first or t_end
    n_out = len(final.outputs[0].token_ids) if final else 0
    return {
        "prompt_tokens": len(final.prompt_token_ids) if final else 0,
        "ttft": t_first - t0,
        "decode_tokens": max(n_out - 1, 0),
        "decode_time": t_end - t_first,
        "finish_reason": final.outputs[0].finish_reason if final else None,
    }
