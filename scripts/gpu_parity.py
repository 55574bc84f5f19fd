"""bf16 greedy parity on the GPU: verispec vs Hugging Face transformers on the same weights.

Where verispec (bf16) and transformers (bf16) differ, the script also runs transformers in float32
and reports which of the two bf16 runs stays closer to it: a divergence that float32 resolves
either way at a near-tie is bf16 rounding, not a bug. Usage: python scripts/gpu_parity.py MODEL.gguf
[--one-by-one]; --one-by-one generates each prompt alone, so decode runs the batch-1 kernels (the
one-row GEMV, qkv + rotary and the norm prologues), where all prompts together run the batched ones.
"""

import sys

import torch

from verispec import LLM, SamplingParams
from verispec.bench.peers import hf_model

PROMPTS = [
    "def fibonacci(n):", "# quicksort in Python\n", "SELECT name, COUNT(*) FROM users\n",
    "<|im_start|>user\nWhat is a hash map?<|im_end|>\n<|im_start|>assistant\n",
    "class Matrix:\n    def __init__(self, rows, cols):\n", "// reverse a string in C\n",
]
N = 64


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def main(path: str, one_by_one: bool) -> None:
    llm = LLM(path, device="cuda", dtype="bfloat16", max_model_len=2048)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    groups = [[p] for p in ids] if one_by_one else [ids]
    ours = [o.outputs[0].token_ids for g in groups for o in llm.generate(prompt_token_ids=g, sampling_params=sp)]
    hf = hf_model(llm.engine.parts.model).eval()
    equal = 0
    for p, o in zip(ids, ours, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        d = first_diff(o, ref)
        if d is None:
            equal += 1
            print(f"equal ({N} tokens): {p[:6]}")
            continue
        # Logit margin of the float32 model at the divergence, on our prefix.
        with torch.no_grad():
            hf32 = hf.float()
            lg = hf32(torch.tensor([p + o[:d]], device="cuda")).logits[0, -1].float()
            hf.to(torch.bfloat16)
        top2 = lg.topk(2)
        print(f"diverge at {d}: ours {o[d]} hf-bf16 {ref[d]} | fp32 top2 {top2.indices.tolist()} margin {float(top2.values[0]-top2.values[1]):.4f}")
    mode = "one prompt at a time" if one_by_one else "all prompts in one batch"
    print(f"RESULT bf16 greedy ({mode}): {equal}/{len(ids)} prompts identical for {N} tokens")


if __name__ == "__main__":
    main(sys.argv[1], "--one-by-one" in sys.argv[2:])
