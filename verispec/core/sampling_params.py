"""Sampling parameters with vLLM's names. Every bad value raises ValueError naming the field."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from verispec.core.structured import StructuredOutputsParams

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams", "any_params", "with_output_kind"]


class RequestOutputKind(enum.Enum):
    """Which RequestOutputs LLMEngine.step() returns for a request (vLLM's name)."""

    CUMULATIVE = 0  # after every step that changed it: all text and tokens so far (streaming)
    FINAL_ONLY = 2  # once, when it finishes (LLM.generate: no per-step output is built)


@dataclass
class SamplingParams:
    """How one request samples. Field names and defaults follow vLLM."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # {token id: bias} added to the logits of every row the request samples or verifies (OpenAI's range).
    logit_bias: dict[int, float] | None = None
    # A grammar the output must follow (JSON schema, regex, EBNF, choice); compiled (checked) here.
    structured_outputs: StructuredOutputsParams | None = None
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):  # a scalar is a ValueError naming the field, not a TypeError
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(f"SamplingParams.{name} must be a list (or None), got {value!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0 and not isinstance(self.top_k, bool):
            self.top_k = -1  # vLLM: 0 and -1 both mean "all tokens"; -1 is how verispec stores it
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        def is_num(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not is_num(self.temperature) or not (0.0 <= self.temperature <= 100.0) or self.temperature != self.temperature:
            bad("temperature", "must be a number in [0, 100]")
        if not is_num(self.top_p) or not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            bad("top_k", "must be -1 or 0 (off) or an integer >= 1")
        if not is_num(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "must be an integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not (-2.0 <= v <= 2.0):
                bad(name, "must be in [-2, 2]")
        if not is_num(self.repetition_penalty) or not (0.0 < self.repetition_penalty <= 10.0):
            bad("repetition_penalty", "must be in (0, 10]")
        if self.logprobs is not None and (not is_int(self.logprobs) or not (0 <= self.logprobs <= 20)):
            bad("logprobs", "must be None or an integer in [0, 20]")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad("output_kind", "must be a RequestOutputKind")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                is_int(t) and t >= 0 and is_num(b) and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()
            ):
                bad("logit_bias", "must be a dict of token id (integer >= 0) to bias in [-100, 100]")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be a StructuredOutputsParams")
            self.structured_outputs.validate()  # compiles the grammar: a bad one raises now, naming the problem

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_logit_processing(self) -> bool:
        """True when the verifier changes this request's logits beyond min_tokens: penalties, a
        logit bias or a grammar mask."""
        return self.needs_penalties or bool(self.logit_bias) or self.structured_outputs is not None


def with_output_kind(params: list[SamplingParams], kind: RequestOutputKind) -> list[SamplingParams]:
    """params asking for `kind` outputs: those that already do as they are, copies of the others (one
    copy per distinct object, so a list repeating one object repeats its copy); the caller's objects
    are left unchanged."""
    copies: dict[int, SamplingParams] = {}
    out = []
    for sp in params:
        if sp.output_kind is not kind:
            c = copies.get(id(sp))
            if c is None:
                c = copies[id(sp)] = dataclasses.replace(sp, output_kind=kind)
            sp = c
        out.append(sp)
    return out


def any_params(params: Iterable[SamplingParams], pred: Callable[[SamplingParams], bool]) -> bool:
    """any(pred(p) for p in params), with pred asked once per run of the same object: the requests
    of one generate() call share their SamplingParams, and the engine asks this every step."""
    seen = None
    for p in params:
        if p is not seen:
            if pred(p):
                return True
            seen = p
    return False
