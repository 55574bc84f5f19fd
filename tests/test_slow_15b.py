"""The 1.5B on CPU in float32 (slow: run with -m slow): transformers parity on 2 prompts, and
lossless greedy decoding with the 0.5B as draft model."""

from __future__ import annotations

import pytest
import torch

from verispec import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):", "<|im_start|>user\nWrite a function that reverses a list.<|im_end|>\n<|im_start|>assistant\n"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def llm15(qwen15_path):
    return LLM("qwen2.5-coder-1.5b-instruct", device="cpu", dtype="float32", quantization="none", max_model_len=1024)


def test_15b_matches_transformers(llm15, qwen15_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(qwen15_path.parent), gguf_file=qwen15_path.name, dtype=torch.float32).eval()
    ids = [llm15.tokenizer.encode(p) for p in PROMPTS]
    outs = llm15.generate(prompt_token_ids=ids, sampling_params=GREEDY)
    for p, o in zip(ids, outs, strict=True):
        toks = o.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([p + toks])).logits[0].float()
        assert logits[len(p) - 1 : -1].argmax(-1).tolist() == toks


def test_15b_with_05b_draft_is_lossless(llm15, qwen05_path):
    ids = [llm15.tokenizer.encode(p) for p in PROMPTS]
    ref = [o.outputs[0].token_ids for o in llm15.generate(prompt_token_ids=ids, sampling_params=GREEDY)]
    spec = LLM("qwen2.5-coder-1.5b-instruct", device="cpu", dtype="float32", quantization="none", max_model_len=1024,
               speculative_config={"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4,
                                   "adaptive": False},
               max_num_batched_tokens=32, num_gpu_blocks=12)
    got = [o.outputs[0].token_ids for o in spec.generate(prompt_token_ids=ids, sampling_params=GREEDY)]
    assert got == ref
    m = spec.get_metrics()
    assert m["spec_decode_num_accepted_tokens"] > 0.5 * m["spec_decode_num_draft_tokens"]
