"""Every invalid SamplingParams value raises ValueError naming the field."""

import pytest

from verispec import SamplingParams

BAD = [
    ("n", 0), ("n", 1.5), ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 1.5), ("min_p", -0.1), ("min_p", 1.1), ("seed", 1.5), ("max_tokens", 0),
    ("max_tokens", -5), ("min_tokens", -1), ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]),
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0), ("logprobs", 21),
    ("logprobs", -1), ("temperature", "hot"), ("max_tokens", True),
    ("stop", 5), ("stop_token_ids", 5), ("stop_token_ids", "3"), ("stop", {"a": 1}),
]


@pytest.mark.parametrize(("field", "value"), BAD)
def test_bad_value_names_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_good_values_and_normalisation():
    sp = SamplingParams(temperature=0, stop="###", top_k=5, seed=3)
    assert sp.greedy and sp.stop == ["###"] and sp.stop_token_ids == []


@pytest.mark.parametrize("off", [0, -1])
def test_top_k_zero_and_minus_one_mean_off(off):
    """vLLM's semantics: top_k 0 and -1 both keep every token; verispec stores either as -1."""
    assert SamplingParams(top_k=off).top_k == -1
