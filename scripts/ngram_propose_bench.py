"""Time NgramProposer.propose for 64 requests as their tokens grow (2 a step, 200 steps, best of 3).

    PYTHONPATH=$PWD python3 scripts/ngram_propose_bench.py PROMPT_LEN"""
import random
import sys
import time

from verispec import SamplingParams
from verispec.core.request import Request
from verispec.spec_decode.ngram import NgramProposer

L = int(sys.argv[1])
steps, batch = 200, 64
rng = random.Random(0)
reqs = []
for i in range(batch):
    motif = [rng.randrange(10, 500) for _ in range(8)]
    reqs.append(Request(f"r{i}", (motif * (L // 8 + 1))[:L], SamplingParams(max_tokens=10**6)))
prop = NgramProposer(4, 1, 4)
best = None
for _rep in range(3):
    for r in reqs:
        del r.output_token_ids[:]
    prop = NgramProposer(4, 1, 4)
    t = 0.0
    for _s in range(steps):
        for r in reqs:
            r.output_token_ids += [rng.randrange(10, 500), rng.randrange(10, 500)]
        t0 = time.thread_time()
        prop.propose(reqs)
        t += time.thread_time() - t0
    best = t if best is None else min(best, t)
print(f"prompt {L}: {1e6 * best / steps / batch:.2f} us per request per step (context {L}..{L + 2 * steps})")
