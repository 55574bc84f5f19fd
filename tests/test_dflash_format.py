"""The published DFlash checkpoint layout (z-lab's DFlashDraftModel, as vLLM and SGLang load it).

A checkpoint is written here by hand (config dict and tensors under the published names, straight
through safetensors; save_drafter is not involved), then: verispec's drafter computes the same block
logits as a plain-torch reference forward written from the published description, fed with the
target hidden states transformers reports (hidden_states[id + 1]); save_drafter writes exactly the
published names and round-trips bit for bit; mismatched targets and unsupported features are refused
by name; and an engine drafting with the hand-written checkpoint is lossless.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from tiny import run_all, tiny_config, tiny_engine, tiny_model

from verispec import SamplingParams
from verispec.config import ModelConfig
from verispec.spec_decode.dflash import load_drafter, save_drafter
from verispec.spec_decode.dflash_model import (
    DFlashDrafter,
    block_attention_mask,
    default_target_layers,
    new_config,
    target_fingerprint,
)

VOCAB = tiny_config().vocab_size
H = tiny_config().hidden_size
MASK_ID = VOCAB - 1
# The drafter's own shape differs from the tiny target's on purpose: GQA 4:1, head_dim 32 (not H / heads),
# its own rope theta and norm eps. Layer id 1 is the target's last layer (read after the final norm).
LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER, THETA, EPS, BLOCK = 2, 4, 1, 32, 96, 10000.0, 1e-5, 4
LAYER_IDS = [0, 1]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def hand_config(**over) -> dict:
    """A config.json as the published drafters have it (Qwen3 fields, dflash_config, auto_map...)."""
    d = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": BLOCK,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": LAYER_IDS},
        "dtype": "float32",
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "layer_types": ["full_attention"] * LAYERS,
        "max_position_embeddings": 4096,
        "max_window_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "num_target_layers": 2,
        "rms_norm_eps": EPS,
        "rope_scaling": None,
        "rope_theta": THETA,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }
    d.update(over)
    return d


def hand_tensors(seed: int = 5, n_features: int = len(LAYER_IDS)) -> dict[str, torch.Tensor]:
    """Random weights under the published names (large enough that drafts depend on the context)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.15):
        return torch.randn(shape, generator=g) * std

    def norm(n):
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    t = {"fc.weight": w(H, n_features * H, std=0.1), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        t |= {
            p + "input_layernorm.weight": norm(H),
            p + "post_attention_layernorm.weight": norm(H),
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, H),
            p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, H),
            p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, H),
            p + "self_attn.o_proj.weight": w(H, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": norm(HEAD_DIM),
            p + "self_attn.k_norm.weight": norm(HEAD_DIM),
            p + "mlp.gate_proj.weight": w(INTER, H),
            p + "mlp.up_proj.weight": w(INTER, H),
            p + "mlp.down_proj.weight": w(H, INTER),
        }
    return t


def write_checkpoint(path, config: dict, tensors: dict[str, torch.Tensor]):
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def read_tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


# ---- the reference: the published description in plain torch -------------------------------------------
def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half rope of x [T, heads, D] at absolute positions pos [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None]
    cos, sin = (torch.cat([f(ang), f(ang)], -1).float()[:, None] for f in (torch.cos, torch.sin))
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_drafts(t: dict[str, torch.Tensor], ctx_feats: torch.Tensor, block_ids: list[int], embed: torch.Tensor,
                     lm_head: torch.Tensor) -> torch.Tensor:
    """Logits [B-1, V] of the drafts of one block: target features of positions 0..n-1 (the published
    target_layer_ids' hidden states, concatenated) -> fc -> hidden_norm; the block [anchor, MASK...] at
    positions n..n+B-1 through the target's embedding; each layer's queries (input_layernorm, q_proj,
    q_norm, rope) attend, without a causal mask, to keys and values of [context ; block] (k_proj and
    v_proj of the normed context and of the normed block, k_norm, rope at their positions); o_proj,
    residual, post_attention_layernorm, SiLU MLP, residual; the final norm; the target's LM head. Block
    position j predicts the token at n + j."""
    n, b = ctx_feats.shape[0], len(block_ids)
    ctx = rms(ctx_feats @ t["fc.weight"].T, t["hidden_norm.weight"], EPS)
    x = embed[block_ids]
    pos = torch.arange(n + b)
    for i in range(LAYERS):
        p = f"layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"], EPS)
        q = rms((h @ t[p + "self_attn.q_proj.weight"].T).view(b, HEADS, HEAD_DIM), t[p + "self_attn.q_norm.weight"], EPS)
        both = torch.cat([ctx, h])
        k = rms((both @ t[p + "self_attn.k_proj.weight"].T).view(n + b, KV_HEADS, HEAD_DIM),
                t[p + "self_attn.k_norm.weight"], EPS)
        v = (both @ t[p + "self_attn.v_proj.weight"].T).view(n + b, KV_HEADS, HEAD_DIM)
        q, k = rotate(q, pos[n:], THETA), rotate(k, pos, THETA)
        k, v = (z.repeat_interleave(HEADS // KV_HEADS, dim=1) for z in (k, v))
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5, dim=-1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(b, HEADS * HEAD_DIM) @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"], EPS)
        gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    return (rms(x, t["norm.weight"], EPS) @ lm_head.T)[1:]


# ---- fixtures --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def hf(model):
    """The tiny target in transformers (the source of the published reference's hidden states)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    c = model.config
    hc = Qwen2Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                     max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
                     rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=False)
    m = Qwen2ForCausalLM(hc).eval()
    m.load_state_dict({k: v.detach().clone() for k, v in model.hf_state_dict().items()}, strict=True)
    return m


def hf_features(hf, tokens: list[int], offset: int = 1) -> torch.Tensor:
    """[T, n*H]: transformers' hidden_states[id + offset] of every published target layer id, concatenated."""
    with torch.no_grad():
        hs = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i + offset][0] for i in LAYER_IDS], dim=-1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("published"), hand_config(), hand_tensors())


def prompts(n=3, seed=4) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(100, 3000) for _ in range(18)]
    return [base + [rng.randrange(100, 3000) for _ in range(rng.randrange(2, 15))] for _ in range(n)]


def spec(path, k=3, adaptive: bool = True) -> dict:
    return {"method": "dflash", "model": str(path), "num_speculative_tokens": k, "adaptive": adaptive}


# ---- (a) the same math as the published reference --------------------------------------------------------
def test_block_logits_equal_published_reference(model, hf, ckpt):
    t = hand_tensors()
    d = load_drafter(ckpt, "cpu", torch.float32)
    cfg = d.config
    assert (cfg.target_layers, cfg.block_size, cfg.mask_token_id, cfg.num_target_layers) == (LAYER_IDS, BLOCK, MASK_ID, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.rms_norm_eps) == (
        HEADS, KV_HEADS, HEAD_DIM, THETA, EPS)
    assert cfg.target_fingerprint is None and cfg.target_name == ""
    embed, lm_head = model.model.embed_tokens.weight, model.lm_head_weight
    toks = prompts(1)[0]
    for n in (5, len(toks) - 1):  # a short and a long context
        feats = hf_features(hf, toks[:n])
        block = [toks[n]] + [MASK_ID] * (BLOCK - 1)
        want = reference_drafts(t, feats, block, embed, lm_head)
        with torch.no_grad():
            ctx = [(k[None], v[None]) for k, v in d.context_kv(feats, torch.arange(n))]
            mask = block_attention_mask(torch.tensor([[n]]), torch.ones(1, n, dtype=torch.bool), BLOCK)
            got = model.compute_logits(d(embed[block][None], n + torch.arange(BLOCK)[None], ctx, mask)[0, 1:])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        # The reference is sensitive to what it is fed: hidden_states[id] (no +1) gives other logits.
        assert not torch.allclose(reference_drafts(t, hf_features(hf, toks[:n], 0), block, embed, lm_head), want,
                                  atol=1e-3)


def test_engine_drafts_equal_published_reference(model, hf, ckpt):
    """Inside the engine (the target's captured layers, the paged context cache, the drafting step),
    the first block of a request has the reference's logits: verispec's captured layer i is
    transformers' hidden_states[i + 1], the last layer's after the final norm."""
    eng = tiny_engine(model, spec=spec(ckpt, k=BLOCK - 1, adaptive=False))  # every step drafts a full block
    assert eng.runner.capture_layers == tuple(LAYER_IDS)
    prop, seen = eng.proposer, []
    real = prop._draft_logits

    def spy(todo, sources):
        out = real(todo, sources)
        seen.append(([(list(r.all_token_ids), k) for r, k, _ in todo], out.clone()))
        return out

    prop._draft_logits = spy
    p = prompts(1)[0]
    eng.add_request("r0", None, GREEDY, p)
    while eng.has_unfinished_requests() and len(seen) < 3:
        eng.step()
    assert len(seen) == 3
    t = hand_tensors()
    for [(tokens, k)], logits in seen:
        n = len(tokens) - 1
        want = reference_drafts(t, hf_features(hf, tokens[:n]), [tokens[n]] + [MASK_ID] * (BLOCK - 1),
                                model.model.embed_tokens.weight, model.lm_head_weight)
        torch.testing.assert_close(logits[0, :k], want[:k], atol=1e-4, rtol=1e-4)


# ---- (b) save_drafter writes the published layout, bit-exactly ------------------------------------------
def test_save_writes_published_names_and_round_trips(ckpt, tmp_path):
    from transformers import Qwen3Config

    d = load_drafter(ckpt, "cpu", torch.float32)
    save_drafter(d, tmp_path / "a", torch.float32)
    saved, hand = read_tensors(tmp_path / "a"), hand_tensors()
    assert set(saved) == set(hand)  # exactly the published names: no embedding, no LM head
    assert all(saved[k].dtype == torch.float32 and torch.equal(saved[k], hand[k]) for k in hand)
    with safe_open(str(tmp_path / "a" / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    ref = hand_config()
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": LAYER_IDS}
    for key in ("block_size", "num_target_layers", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta",
                "max_position_embeddings", "vocab_size", "attention_bias", "layer_types", "use_sliding_window"):
        assert cfg[key] == ref[key], key
    hc = Qwen3Config.from_pretrained(tmp_path / "a")  # what vLLM / SGLang / transformers parse
    assert (hc.hidden_size, hc.num_hidden_layers, hc.head_dim, hc.num_key_value_heads) == (H, LAYERS, HEAD_DIM, KV_HEADS)
    assert hc.dflash_config == cfg["dflash_config"] and hc.block_size == BLOCK and hc.num_target_layers == 2
    # Round trip: load what was saved, save again: the same bytes.
    save_drafter(load_drafter(tmp_path / "a", "cpu", torch.float32), tmp_path / "b", torch.float32)
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_verispec_drafter_round_trips(model, tmp_path):
    """A drafter made here keeps its config (fingerprint, gamma...) and weights through the published
    layout; bfloat16 saving is exact for bfloat16 weights; the old verispec layout still loads."""
    cfg = new_config(model, "tiny", MASK_ID, block_size=6, num_layers=2)
    d = DFlashDrafter(cfg)
    d.init_weights(seed=1, std=0.2)
    save_drafter(d, tmp_path / "pub", torch.float32)
    e = load_drafter(tmp_path / "pub", "cpu", torch.float32)
    assert e.config == cfg
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), e.state_dict().values(), strict=True))
    keys = set(read_tensors(tmp_path / "pub"))
    assert "layers.1.self_attn.k_norm.weight" in keys and "layers.0.mlp.down_proj.weight" in keys
    assert not any(k.startswith(("layers.0.q_proj", "embed", "lm_head")) for k in keys)
    save_drafter(d, tmp_path / "bf", torch.bfloat16)
    b = load_drafter(tmp_path / "bf", "cpu", torch.bfloat16)
    save_drafter(b, tmp_path / "bf2", torch.bfloat16)
    assert (tmp_path / "bf" / "model.safetensors").read_bytes() == (tmp_path / "bf2" / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "bf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    save_drafter(d, tmp_path / "old", torch.float32, layout="verispec")
    assert json.loads((tmp_path / "old" / "config.json").read_text())["method"] == "dflash"
    o = load_drafter(tmp_path / "old", "cpu", torch.float32)
    assert o.config == cfg
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), o.state_dict().values(), strict=True))


@pytest.mark.parametrize("variant", ["top_level_keys", "rope_parameters", "default_layer_ids", "sharded"])
def test_published_variants_load(ckpt, tmp_path, variant):
    """Forms the published configs take: DFlash keys at the top level, transformers 5's rope_parameters,
    target_layer_ids left to the default rule, weights in shards."""
    c, t = hand_config(), hand_tensors()
    if variant == "top_level_keys":
        c |= c.pop("dflash_config")
    elif variant == "rope_parameters":
        c["rope_parameters"] = {"rope_theta": c.pop("rope_theta"), "rope_type": "default"}
        del c["rope_scaling"]
    elif variant == "default_layer_ids":
        del c["dflash_config"]["target_layer_ids"]  # a target no deeper than the drafter: all its layers
    path = write_checkpoint(tmp_path, c, t)
    if variant == "sharded":
        (path / "model.safetensors").unlink()
        names = sorted(t)
        for i, part in enumerate((names[::2], names[1::2])):
            save_file({k: t[k] for k in part}, str(path / f"model-0000{i + 1}-of-00002.safetensors"))
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {k: f"model-0000{1 + (names.index(k) % 2)}-of-00002.safetensors" for k in names}}))
    d, ref = load_drafter(path, "cpu", torch.float32), load_drafter(ckpt, "cpu", torch.float32)
    assert d.config == ref.config
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), ref.state_dict().values(), strict=True))


def test_default_layer_ids_follow_published_rule():
    """Without target_layer_ids, the published drafters take num_hidden_layers layers spread from 1 to
    L - 3 (the middle one for a 1-layer drafter); verispec's default is the same rule."""
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]  # z-lab's Qwen3-4B/8B drafters
    assert default_target_layers(64, 2) == [1, 61] and default_target_layers(24, 1) == [12]
    assert default_target_layers(28, 5) == [1, 7, 13, 19, 25]


# ---- (c) refusals ----------------------------------------------------------------------------------------
def test_mismatched_targets_are_refused(ckpt, tmp_path):
    with pytest.raises(ValueError, match=r"target of 2 layers \(num_target_layers\), this one has 3"):
        tiny_engine(tiny_model(tiny_config(layers=3)), spec=spec(ckpt))
    narrow = ModelConfig.for_arch("qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                                  num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=4096)
    with pytest.raises(ValueError, match="has hidden size 64, the target 32"):
        tiny_engine(tiny_model(narrow), spec=spec(ckpt))
    with pytest.raises(ValueError, match="has a vocabulary of 4096, the target 2048"):
        tiny_engine(tiny_model(tiny_config(vocab=2048)), spec=spec(ckpt))
    bad_ids = write_checkpoint(tmp_path / "ids", hand_config(dflash_config={"mask_token_id": MASK_ID,
                                                                            "target_layer_ids": [0, 2]}), hand_tensors())
    with pytest.raises(ValueError, match=r"target_layer_ids \[2\] are out of range for this target's 2 layers"):
        tiny_engine(tiny_model(), spec=spec(bad_ids))
    bad_mask = write_checkpoint(tmp_path / "mask", hand_config(dflash_config={"mask_token_id": VOCAB,
                                                                              "target_layer_ids": LAYER_IDS}),
                                hand_tensors())
    with pytest.raises(ValueError, match="mask_token_id 4096 is out of range for this target's vocabulary of 4096"):
        tiny_engine(tiny_model(), spec=spec(bad_mask))
    # verispec's fingerprint, when the config carries one: same shape, other weights.
    fp = write_checkpoint(tmp_path / "fp", hand_config(target_fingerprint=target_fingerprint(tiny_model(seed=1), "tiny-1"),
                                                       target_name="tiny-1"), hand_tensors())
    with pytest.raises(ValueError, match="trained for tiny-1, a different model with the same shape"):
        tiny_engine(tiny_model(), spec=spec(fp))
    tiny_engine(tiny_model(seed=1), spec=spec(fp))  # its own target is fine


def _drop(t: dict, key: str) -> dict:
    return {k: v for k, v in t.items() if k != key}


@pytest.mark.parametrize("case,config,tensors,message", [
    ("arch", dict(architectures=["DFlash2DraftModel"]), None, "verispec runs DFlashDraftModel drafters only"),
    ("sliding", dict(layer_types=["sliding_attention", "full_attention"], sliding_window=64), None,
     r"layer_types \['sliding_attention'\]"),
    ("swa", dict(use_sliding_window=True), None, "sliding-window attention"),
    ("causal", dict(is_causal=True), None, "causal attention"),
    ("bias", dict(attention_bias=True), None, "attention biases"),
    ("rope", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), None, r"rope type \['yarn'\]"),
    ("softcap", dict(final_logit_softcapping=30.0), None, "final_logit_softcapping"),
    ("embed_scale", dict(dflash_config={"mask_token_id": MASK_ID, "target_layer_ids": LAYER_IDS,
                                        "input_embedding_scale": 2.0}), None, "input_embedding_scale 2.0"),
    ("act", dict(hidden_act="gelu"), None, "hidden_act 'gelu'"),
    ("no_mask", dict(dflash_config={"target_layer_ids": LAYER_IDS}), None, "gives no mask_token_id"),
    ("no_rope", dict(rope_theta=None), None, "gives no rope_theta"),
    ("missing", None, "drop_k_norm", r"missing tensors \['layers.1.self_attn.k_norm.weight'\]"),
    ("shape", dict(dflash_config={"mask_token_id": MASK_ID, "target_layer_ids": [0]}), None,
     r"tensor fc.weight has shape \(64, 128\), its config needs \(64, 64\)"),
    ("lm_head", None, "lm_head", r"ships its own \['lm_head.weight'\]"),
    ("stray", None, "stray", r"no place for: \['layers.0.self_attn.q_proj.bias'\]"),
])
def test_unsupported_checkpoints_are_refused(tmp_path, case, config, tensors, message):
    c, t = hand_config(**(config or {})), hand_tensors()
    if case == "no_rope":
        del c["rope_theta"]
    if tensors == "drop_k_norm":
        t = _drop(t, "layers.1.self_attn.k_norm.weight")
    elif tensors == "lm_head":
        t["lm_head.weight"] = torch.zeros(VOCAB, H)
    elif tensors == "stray":
        t["layers.0.self_attn.q_proj.bias"] = torch.zeros(HEADS * HEAD_DIM)
    with pytest.raises(ValueError, match=message):
        load_drafter(write_checkpoint(tmp_path, c, t), "cpu", torch.float32)


# ---- (d) an engine drafting with the hand-written checkpoint is lossless ---------------------------------
@pytest.mark.parametrize("kw", [{}, {"async_scheduling": True}], ids=["sync", "async"])
def test_engine_lossless_with_published_checkpoint(model, ckpt, kw):
    ps = prompts()
    ref = [o.outputs[0].token_ids for o in run_all(tiny_engine(model), ps, GREEDY)]
    # k pinned: the checkpoint drafts every step (adaptive on the CPU's costs, a probe costs more than a
    # plain step, so the policy probes at most every probe_max steps: none in 16 tokens)
    eng = tiny_engine(model, spec=spec(ckpt, adaptive=False), block_size=8, **kw)
    assert eng.proposer.k == BLOCK - 1
    assert [o.outputs[0].token_ids for o in run_all(eng, ps, GREEDY)] == ref
    m = eng.get_metrics()
    assert m["spec_decode_num_drafts"] > 0 and m["spec_decode_num_draft_tokens"] > 0
