"""Gemma 3's tokenizer rebuilt from its GGUF gives transformers' ids (transformers' own GGUF
tokenizer loader on the same file) on a varied corpus, and decodes back to the text."""

from __future__ import annotations

import pytest

CORPUS = [
    "Hello world",
    "def f(x):\n\treturn x**2  # square\n\n\n",
    "class A:\n    def __init__(self):\n        self.items = []\n",
    "  two  spaces   three    four     five",
    "   leading spaces",
    "trailing spaces   ",
    "\t\t\tindent\n    four\r\nwindows line",
    "日本語のテキスト、そして emoji 🤖🎉 and 👩‍👩‍👧",
    "naïve café — «quotes» ∑∫√ ﬁ Ω Ω",
    "Привет, мир! مرحبا بالعالم שלום עולם",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<table><tr><td>1</td></tr></table> <unused0> <mask>",
    "x = {'a': [1, 2, 3]}; y = x['a'][-1] if x else None",
    "1234567890 3.14159 1e-9 0x1F",
    "a" * 50 + " " + "ab" * 20,
    "\u0000\u0001\u0007 control chars \u200b zero width",
    "SELECT name, COUNT(*) FROM users WHERE id <> 3 GROUP BY name;",
    "",
]


@pytest.fixture(scope="module")
def toks(gemma_path):
    from transformers import AutoTokenizer

    from verispec.loader.tokenizer import Tokenizer

    hf = AutoTokenizer.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)
    return Tokenizer.from_gguf(gemma_path), hf


@pytest.mark.parametrize("text", CORPUS)
def test_ids_match_transformers(toks, text):
    ours, hf = toks
    assert ours.encode(text) == hf(text, add_special_tokens=False).input_ids
    # A prompt starts with BOS, as transformers' add_special_tokens=True puts it.
    assert ours.encode_prompt(text) == hf(text).input_ids


@pytest.mark.parametrize("text", CORPUS)
def test_decode_matches_transformers(toks, text):
    ours, hf = toks
    ids = hf(text, add_special_tokens=False).input_ids
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_special_tokens(toks):
    ours, hf = toks
    assert ours.bos_token_id == hf.bos_token_id == 2
    assert ours.eos_token_id == hf.eos_token_id == 1
    assert ours.token_to_id("<end_of_turn>") == hf.convert_tokens_to_ids("<end_of_turn>") == 106
    assert ours.vocab_size == len(hf) == 262144
    # A prompt that already starts with BOS (a rendered chat template) gets no second one.
    assert ours.encode_prompt("<bos>hi") == [2] + ours.encode("hi")


def test_bench_prompts_start_with_bos_like_the_engine(toks):
    """`verispec bench` encodes a text prompt as the engine does (Gemma: BOS first, as transformers)."""
    from verispec.bench.models import BenchModel
    from verispec.bench.prompts import Prompt

    ours, hf = toks
    bm = BenchModel.__new__(BenchModel)  # only the tokenizer is needed to encode
    bm.tokenizer, bm.has_tokenizer = ours, True
    text = "Write a function that reverses a list."
    assert bm.encode(Prompt(text=text, token_ids=None, max_tokens=8)) == hf(text).input_ids
