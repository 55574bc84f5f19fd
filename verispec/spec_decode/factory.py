"""Build the proposer named by speculative_config."""

from __future__ import annotations

from collections.abc import Callable

import torch

from verispec.config import EngineConfig
from verispec.models.qwen2 import CausalLM
from verispec.spec_decode.proposer import Proposer


def build_proposer(
    config: EngineConfig, target: CausalLM, tokenizer, device, dtype, max_model_len: int,
    draft_loader: Callable | None = None,
) -> tuple[Proposer | None, int]:
    """(proposer, extra KV bytes per block the proposer needs). draft_loader(name, device, dtype) ->
    (tokenizer, ModelConfig, CausalLM) loads a draft_model's draft (default: loader.load_model; tests and
    benches pass models they built)."""
    sc = config.speculative_config
    if sc is None:
        return None, 0
    from verispec.loader.model_loader import kv_bytes_per_block, load_model
    from verispec.spec_decode.draft_model import DraftModelProposer
    from verispec.spec_decode.ngram import NgramProposer

    k = sc.num_speculative_tokens
    graphs = 0 if config.enforce_eager else min(config.max_num_seqs, 64)
    lazy = config.graph_capture == "lazy"  # a draft model's longer catch-up shapes follow the target's graphs
    if sc.method == "ngram":
        return NgramProposer(k, sc.prompt_lookup_min, sc.prompt_lookup_max), 0
    if sc.method == "self":
        proposer = DraftModelProposer(target, k, device, dtype, config.seed, graph_max_batch=graphs, lazy_catch_up=lazy)
        return proposer, kv_bytes_per_block(target.config, config.block_size, dtype)
    if sc.method == "draft_model":
        loader = draft_loader or load_model
        draft_tok, draft_cfg, draft = loader(sc.model, device, dtype)
        check_same_vocab(tokenizer, draft_tok, target.config.vocab_size, draft_cfg.vocab_size, sc.model)
        if torch.device(device).type == "cuda":
            from verispec.models.kernel_path import enable_triton, options_of

            enable_triton(draft, options=options_of(target))  # the target's options (defaults unless an A/B set them)
        proposer = DraftModelProposer(draft, k, device, dtype, config.seed, graph_max_batch=graphs, lazy_catch_up=lazy)
        return proposer, kv_bytes_per_block(draft_cfg, config.block_size, dtype)
    if sc.method == "dflash":
        from verispec.spec_decode.dflash import build_dflash_proposer

        return build_dflash_proposer(sc, target, device, dtype, config)
    raise ValueError(f"unknown speculative method {sc.method!r}")


def check_same_vocab(target_tok, draft_tok, target_vocab: int, draft_vocab: int, draft_name: str) -> None:
    """A draft model must share the target's vocabulary, token for token."""
    if target_vocab != draft_vocab:
        raise ValueError(
            f"draft model {draft_name!r} has a vocabulary of {draft_vocab} tokens but the target has "
            f"{target_vocab}: a draft model must use the target's tokenizer"
        )
    probe = list(range(0, min(target_tok.vocab_size, draft_tok.vocab_size), 97))
    if target_tok.convert_ids_to_tokens(probe) != draft_tok.convert_ids_to_tokens(probe):
        raise ValueError(f"draft model {draft_name!r} uses a different tokenizer from the target's")



