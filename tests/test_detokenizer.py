"""Incremental detokenization with the real Qwen2.5 tokenizer."""

from __future__ import annotations

import random

import pytest

from verispec.engine.detokenizer import IncrementalDetokenizer
from verispec.loader.tokenizer import Tokenizer

TEXTS = [
    "Emoji: 😀👍🏽 👨‍👩‍👧‍👦 🇯🇵🇫🇷 and 🦀🐍 done.",
    "中文分词测试，日本語テキスト、한국어 — 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𠜎𠜱𠝹",
    "def f(x):\n    return x ** 2  # ünïcödé ✓\n",
]


@pytest.fixture(scope="module")
def tok(qwen05_path) -> Tokenizer:
    return Tokenizer.from_gguf(qwen05_path)


def stream(det: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None) -> list[str]:
    """Feed ids in chunks (1 token each, or random sizes); return the deltas, flush included."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5) if rng else 1
        deltas.append(det.add_tokens(ids[i : i + n]))
        i += n
    deltas.append(det.flush())
    return deltas


def test_texts_split_characters_across_tokens(tok: Tokenizer) -> None:
    # The test below is only meaningful if some tokens end in the middle of a character.
    split = [t for text in TEXTS for t in tok.encode(text) if "\ufffd" in tok.decode([t])]
    assert len(split) > 5


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunked", [False, True])
def test_deltas_never_split_characters(tok: Tokenizer, text: str, chunked: bool) -> None:
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, tok.encode("Say something:"))
    deltas = stream(det, ids, random.Random(7) if chunked else None)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert det.text == text


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("skip", [True, False])
def test_random_tokens_concatenate_to_decode(tok: Tokenizer, seed: int, skip: bool) -> None:
    rng = random.Random(seed)
    specials = sorted(tok.eos_token_ids) + [tok.token_to_id("<|im_start|>")]
    ids = [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(tok.vocab_size) for _ in range(80)]
    prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 10))]
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = stream(det, ids, rng)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_byte_tokens_of_one_character(tok: Tokenizer) -> None:
    # "😀" spelled as its four single-byte tokens: nothing comes out until the last one.
    ids = [tok.token_to_id(_byte_spelling(b)) for b in "😀".encode()]
    assert None not in ids
    det = IncrementalDetokenizer(tok, [])
    assert [det.add_tokens([i]) for i in ids] == ["", "", "", "😀"]
    assert det.flush() == ""


def _byte_spelling(b: int) -> str:
    """GPT-2 byte-level spelling of one byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


def test_window_stays_small(tok: Tokenizer) -> None:
    """Each call decodes only a few recent tokens, however long the output grows."""
    lengths: list[int] = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            lengths.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    text = " ".join(TEXTS) * 20
    ids = tok.encode(text)
    det = IncrementalDetokenizer(Counting(), tok.encode("prompt " * 50), stop=["never appears!"])
    assert "".join(stream(det, ids)) == text
    assert len(ids) > 500 and max(lengths) <= 12


STOP_TEXT = "The answer is forty-two. 答案是四十二。 END OF STORY and more text after it."


def _expected(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Reference: cut at the stop string that completes first in the full text."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return (text[:end] if include else text[: end - len(s)]), s
    return text, None


@pytest.mark.parametrize("stop", ["END OF STORY", "forty-t", "案是四", "。 E", "Y a", "it."])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cut_exactly(tok: Tokenizer, stop: str, include: bool) -> None:
    ids = tok.encode(STOP_TEXT)
    # The stop must span a token boundary, or the test is not about boundaries.
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)
    det = IncrementalDetokenizer(tok, [], stop=[stop], include_stop_str_in_output=include)
    want, hit = _expected(STOP_TEXT, [stop], include)
    assert hit == stop
    streamed = ""
    for i in ids:
        streamed += det.add_tokens([i])
        # Never stream anything beyond the final output (i.e. never a partial stop string).
        assert want.startswith(streamed)
        if det.stop_hit:
            break
    assert det.stop_hit == stop
    assert streamed == want and det.text == want
    assert det.add_tokens(ids[:3]) == "" and det.flush() == ""


def test_false_start_is_released(tok: Tokenizer) -> None:
    text = "an ans answ answer! final answe"
    det = IncrementalDetokenizer(tok, [], stop=["answer?"])
    deltas = [det.add_tokens([i]) for i in tok.encode(text)]
    assert "".join(deltas) == text[: -len("answe")]  # the tail could still become "answer?"
    assert det.flush() == "answe"
    assert det.stop_hit is None and det.text == text


@pytest.mark.parametrize("seed", range(15))
def test_random_stops_any_chunking(tok: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    text = STOP_TEXT + " " + TEXTS[seed % len(TEXTS)]
    stops = []
    for _ in range(rng.randint(1, 3)):
        a = rng.randrange(len(text) - 1)
        stops.append(text[a : a + rng.randint(1, 8)])
    if seed % 3 == 0:
        stops = ["not in the text", "zzz"]
    include = bool(seed % 2)
    want, hit = _expected(text, stops, include)
    det = IncrementalDetokenizer(tok, tok.encode("prompt"), stop=stops, include_stop_str_in_output=include)
    deltas = stream(det, tok.encode(text), rng)
    assert "".join(deltas) == want
    assert det.stop_hit == hit


def test_bad_stop_rejected(tok: Tokenizer) -> None:
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, [], stop=[""])
