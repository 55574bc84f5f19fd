"""The offline API: LLM(...).generate(...), with vLLM's names."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from verispec.config import DEFAULT_MODEL, EngineConfig
from verispec.engine.engine import LLMEngine
from verispec.outputs import RequestOutput
from verispec.sampling_params import RequestOutputKind, SamplingParams, with_output_kind


class LLM:
    """Load a model once, then generate for batches of prompts."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        """kwargs: exactly EngineConfig's fields (verispec/config.py: types, defaults and help), vLLM's names.
        An unknown keyword is a TypeError and a bad value a ValueError, both raised before the model loads."""
        config = EngineConfig.from_kwargs({"model": model, **kwargs}, caller="LLM()")
        self.engine = LLMEngine(config)
        self.config = self.engine.config  # resolved: no 'auto' device or dtype left
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        if prompts is not None and prompt_token_ids is not None:
            raise ValueError("pass either prompts or prompt_token_ids, not both")
        if prompts is None and prompt_token_ids is None:
            raise ValueError("generate() needs prompts or prompt_token_ids")
        items: list[tuple[str | None, list[int] | None]]
        if prompts is not None:
            prompts = [prompts] if isinstance(prompts, str) else list(prompts)
            items = [(p, None) for p in prompts]
        else:
            items = [(None, list(ids)) for ids in prompt_token_ids]
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else None
            if params is None or not all(isinstance(sp, SamplingParams) for sp in params):
                # vLLM takes a SamplingParams or a list of them; a dict (or anything else) is refused here,
                # before any request is queued, rather than failing deep in the engine.
                got = type(sampling_params).__name__ if params is None else "a list holding other things"
                raise TypeError(f"sampling_params must be a SamplingParams or a list of SamplingParams, got {got}")
            if len(params) != len(items):
                raise ValueError(f"got {len(params)} sampling_params for {len(items)} prompts")
        params = with_output_kind(params, RequestOutputKind.FINAL_ONLY)  # generate() reads only the last
        ids = []
        try:
            for (text, toks), sp in zip(items, params, strict=True):
                rid = str(next(self._ids))
                self.engine.add_request(rid, text, sp, toks)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Render the model's chat template, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not convs:
            raise ValueError("messages must be a non-empty list")
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        want = set(ids)
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm)
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in want:
                    done[out.request_id] = out
                    bar.update(1)
            if not self.engine.has_unfinished_requests() and len(done) < len(ids):
                raise RuntimeError("engine stopped with requests unfinished")
        bar.close()
        return [done[i] for i in ids]

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel rank processes (they also stop when this process exits)."""
        self.engine.shutdown()

    def get_metrics(self) -> dict:
        return self.engine.get_metrics()


def _signature() -> inspect.Signature:
    """LLM.__init__'s signature as help() and IDEs should show it: model, then EngineConfig's keywords."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in dataclasses.fields(EngineConfig):
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if f.name == "model" else inspect.Parameter.KEYWORD_ONLY
        params.append(inspect.Parameter(f.name, kind, default=f.default, annotation=f.type))
    return inspect.Signature(params, return_annotation=None)


LLM.__init__.__signature__ = _signature()

