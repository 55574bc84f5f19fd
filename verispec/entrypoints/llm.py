"""The offline API: LLM(...).generate(...), with vLLM's names."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from verispec.config import EngineConfig, SpeculativeConfig
from verispec.engine.engine import LLMEngine
from verispec.loader.registry import DEFAULT_MODEL
from verispec.outputs import RequestOutput
from verispec.sampling_params import RequestOutputKind, SamplingParams, with_output_kind


class LLM:
    """Load a model once, then generate for batches of prompts."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        device: str = "auto",
        dtype: str = "auto",
        speculative_config: dict | None = None,
        async_scheduling: bool | None = None,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        seed: int = 0,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        num_gpu_blocks: int | None = None,
        spec_audit_rate: float = 0.0,
        **extra,
    ) -> None:
        from verispec.loader.model_loader import resolve_device_dtype

        dev, _ = resolve_device_dtype(device, dtype)
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        if not 0.0 <= spec_audit_rate <= 1.0:
            raise ValueError(f"spec_audit_rate must be in [0, 1], got {spec_audit_rate!r}")
        self.config = EngineConfig(
            model=model,
            device=dev.type if dev.index is None else str(dev),
            dtype=dtype if dtype != "auto" else ("float32" if dev.type == "cpu" else "bfloat16"),
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
            async_scheduling=bool(async_scheduling) if async_scheduling is not None else dev.type == "cuda",
            seed=seed,
            speculative_config=SpeculativeConfig.from_dict(speculative_config),
            spec_audit_rate=spec_audit_rate,
            extra=extra,
        )
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = False,
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
            params = list(sampling_params)
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
        use_tqdm: bool = False,
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

    def get_metrics(self) -> dict:
        return self.engine.get_metrics()

