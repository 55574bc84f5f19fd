"""Greedy generation with the real 0.5B equals Hugging Face transformers (same GGUF, float32, CPU).

Token-for-token equality is checked by teacher forcing: one transformers forward over prompt +
our 64 tokens must put its argmax on our next token at every generated position (by induction
that is exactly "transformers' greedy decode gives the same tokens"), and the logits at the last
step must agree within 1e-3 relative.
"""

from __future__ import annotations

import pytest
from tiny import hf_logits, prefill_logits

from verispec import SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "# Write a quicksort in Python\n",
    "<|im_start|>user\nExplain what a hash map is in one paragraph.<|im_end|>\n<|im_start|>assistant\n",
    "SELECT name, COUNT(*) FROM users\n",
    "// C function that reverses a string in place\nvoid reverse(char *s) {",
    "Les nombres premiers inférieurs à 20 sont",
    "数据结构中的栈是",
    "class Matrix:\n    def __init__(self, rows, cols):\n        \t",
]
NUM_TOKENS = 64


@pytest.fixture(scope="module")
def ours(llm05):
    ids = [llm05.tokenizer.encode(p) for p in PROMPTS]
    sp = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm05.generate(prompt_token_ids=ids, sampling_params=sp)
    return [(i, o.outputs[0].token_ids) for i, o in zip(ids, outs, strict=True)]


def test_greedy_matches_transformers_token_for_token(hf05, ours):
    for prompt_ids, toks in ours:
        assert len(toks) == NUM_TOKENS
        logits = hf_logits(hf05, prompt_ids + toks)
        hf_next = logits[len(prompt_ids) - 1 : -1].argmax(-1).tolist()
        mismatch = [i for i, (a, b) in enumerate(zip(hf_next, toks, strict=True)) if a != b]
        assert not mismatch, f"prompt {prompt_ids[:8]}...: first divergence at generated token {mismatch[:1]}"


def test_last_step_logits_match_transformers(hf05, llm05, ours):
    for prompt_ids, toks in ours[:4]:
        seq = prompt_ids + toks[:-1]
        ref = hf_logits(hf05, seq)[-1]
        got = prefill_logits(llm05, seq, last=True)
        rel = float((got - ref).norm() / ref.norm())
        assert rel < 1e-3, rel
        assert int(got.argmax()) == toks[-1]
