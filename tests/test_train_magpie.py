"""train-drafter's Magpie prompt source and resumable state: the user-turn prefix cut from the real Qwen chat
template, the held-out / duplicate filter, seeded reproducibility, a CLI run with Magpie requests (tiny
random-weight target over the real vocabulary), and a stopped + resumed run equal to an uninterrupted one."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import text_model, tiny_engine, tiny_model

from verispec.train import data as tdata
from verispec.train import magpie

REPO = Path(__file__).resolve().parents[1]
HELDOUT = [json.loads(x)["prompt"] for x in (REPO / "prompts" / "heldout_requests.jsonl").read_text().splitlines()
           if x.strip()]


@pytest.fixture(scope="module")
def tok():
    from tiny import real_tokenizer  # pulls the real 0.5B on first use, as every real-model test does

    return real_tokenizer()


def test_user_turn_prefix_from_the_qwen_template(tok):
    # Qwen2.5's documented ChatML layout: a default system turn when none is given, then the user's turn.
    prefix, suffix = magpie.user_turn_split(tok)
    assert prefix == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                      "<|im_end|>\n<|im_start|>user\n")
    assert suffix.startswith("<|im_end|>")
    assert tok.token_to_id("<|im_end|>") in magpie.end_of_turn_ids(tok, suffix)
    prefix, _ = magpie.user_turn_split(tok, "Be brief.")
    assert prefix == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    hist = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}]
    prefix, _ = magpie.user_turn_split(tok, "Be brief.", hist)
    assert prefix == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n"
                      "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\n")
    ids = tok.encode(magpie.user_turn_split(tok)[0])
    assert ids[-3:] == [tok.token_to_id("<|im_start|>"), *tok.encode("user\n")]  # special tokens parsed as such
    # The response prompt of a request is the template's own rendering, generation prompt included.
    assert tok.decode(magpie.chat_ids(tok, None, [{"role": "user", "content": "Hi there"}]),
                      skip_special_tokens=False).endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")


def test_template_that_rewrites_the_user_text_is_refused():
    class Shouting:
        def apply_chat_template(self, msgs, add_generation_prompt=False):
            return "".join(f"[{m['role']}] {m['content'].upper()}\n" for m in msgs)

    with pytest.raises(ValueError, match="verbatim"):
        magpie.user_turn_split(Shouting())


def test_heldout_and_duplicate_filter():
    f = magpie.RequestFilter(magpie.heldout_texts(), max_per_opening=2)
    # Every held-out request, verbatim or lightly edited, is dropped.
    assert not any(f.offer(t) for t in HELDOUT)
    assert not f.offer("  " + HELDOUT[0].upper().replace(",", "") + "  ")
    assert not f.offer("Please, could you " + HELDOUT[2][0].lower() + HELDOUT[2][1:] + " Thanks a lot!")
    # HumanEval: its first problem's docstring, reworded only at the edges.
    he = ("Check if in given list of numbers, are any two numbers closer to each other than given threshold. "
          "Write it in Python.")
    assert not f.offer(he)
    assert f.stats.heldout == len(HELDOUT) + 3 and f.stats.kept == 0
    ok = "How can I memoize a recursive function that counts lattice paths in a grid, using only a dict?"
    assert f.offer(ok)
    assert not f.offer(ok) and not f.offer(ok.lower().replace("?", "!"))  # exact, after normalizing
    assert not f.offer(ok.replace("using only a dict", "using only a plain dict"))  # near duplicate
    assert f.stats.duplicate == 3
    assert not f.offer("Sort it.")  # too short (not a sentence)
    assert not f.offer("#include <stdio.h>\nint main() { return 0; } /* write docs for it */")  # code, no request
    assert not f.offer("Certainly! Here is a function that reverses a string in Python for you.")  # an answer
    assert not f.offer("from Dockerfile\n\nFROM ubuntu:latest\nRUN apt-get update && apt-get install -y git")
    assert not f.offer("Use R for a machine learning example.\n\nSure, I can help you with that! Let's start.")
    assert f.offer("请用Python写一个函数，计算列表中所有偶数的平均值。")  # other languages are requests too
    assert not f.offer("How can I tell", complete=False)  # cut at max_tokens
    assert f.offer("How can I profile a slow pandas groupby over ten million rows?")
    assert not f.offer("How can I stream a large JSON file in Node.js without loading it all?")  # 3rd "how can i"
    assert f.stats.opening == 1 and f.stats.kept == 3 and f.stats.not_request == 5  # "Sort it.", #include, Certainly, Dockerfile, Sure


def test_heldout_extra_files(tmp_path):
    extra = tmp_path / "mine.jsonl"
    extra.write_text(json.dumps({"prompt": "Write a Rust program that tails a log file and counts HTTP 500s."}) + "\n")
    (tmp_path / "lines.txt").write_text("Explain monads to a Haskell beginner with one small example.\n")
    f = magpie.RequestFilter(magpie.heldout_texts([extra, tmp_path / "lines.txt"]))
    assert not f.offer("Write a Rust program that tails a log file and counts HTTP 500s.")
    assert not f.offer("explain monads to a haskell beginner with one small example")
    assert f.offer("Write a Go program that tails a log file and reports the slowest endpoints per minute.")


def test_chat_rendering_of_requests_and_stubs():
    class Tok:
        def apply_chat_template(self, msgs, add_generation_prompt=True):
            return "<u>" + msgs[0]["content"]

    nl, stub = tdata.render_prompts(Tok(), [HELDOUT[0], 'def f(x):\n    """Return x."""\n'])
    assert nl == "<u>" + HELDOUT[0]  # a request is the user message itself (bench spec --chat on held-out sets)
    assert any(stub.startswith(f"<u>{x}\n\n```python\ndef f(x):") for x in tdata.INSTRUCTIONS)  # a stub: completed


@pytest.fixture(scope="module")
def big():
    return text_model()


def sample(big, seed: int, **kw) -> list[magpie.Request]:
    mo = magpie.MagpieOptions(max_tokens=8, keep_incomplete=True, min_chars=8, oversample=1.0)
    eng = tiny_engine(big, num_gpu_blocks=64, **kw)
    return magpie.first_requests(eng, 5, seed, time.monotonic() + 600, mo, magpie.make_filter(5, mo))


def test_magpie_requests_are_seeded(big):
    a = sample(big, 3, max_num_seqs=4)
    assert len(a) == 5 and len({r.text for r in a}) == 5 and all(r.text.strip() for r in a)
    assert len({r.system for r in a}) >= 3  # the system prompts cycle
    # Independent of how the engine batches and steps them.
    assert sample(big, 3, max_num_seqs=16, async_scheduling=True) == a
    b = sample(big, 4, max_num_seqs=4)
    assert [r.text for r in b] != [r.text for r in a]


def test_train_drafter_with_magpie_prompts(big, tmp_path, capsys):
    from verispec.entrypoints.cli import build_parser, dispatch
    from verispec.train.cli import cmd_train_drafter

    def main(argv):
        args = build_parser().parse_args(argv)
        return dispatch(args, lambda a: cmd_train_drafter(
            a, engine_factory=lambda opts: tiny_engine(big, max_num_seqs=8, num_gpu_blocks=128)))

    out = tmp_path / "run"
    assert main(["train-drafter", "--target", "tiny", "--out", str(out), "--minutes", "5", "--device", "cpu",
                 "--prompt-sources", "magpie,json", "--num-prompts", "8", "--magpie-share", "0.75",
                 "--magpie-max-tokens", "10", "--magpie-keep-incomplete", "--multi-turn", "1.0",
                 "--max-new-tokens", "6", "--responses-per-prompt", "2", "--max-steps", "2", "--batch-seqs", "2",
                 "--anchors", "2", "--block-size", "4", "--layers", "1", "--save-dtype", "float32"]) == 0
    rows = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    first = [r for r in rows if r["turn"] == 1]
    assert len(first) == 6 and len({r["text"] for r in rows}) == len(rows)
    assert any(r["turn"] == 2 for r in rows)  # second user turns, conditioned on the first exchange
    assert not {magpie.normalize(r["text"]) for r in rows} & {magpie.normalize(t) for t in HELDOUT}
    seqs = [json.loads(x) for x in (out / "sequences.jsonl").read_text().splitlines()[1:]]
    groups = {r["group"] for r in first}
    stub_groups = {s["group"] for s in seqs} - groups
    assert len(stub_groups) == 2  # the json package's stubs: 8 - 6 prompts
    assert {s["temperature"] for s in seqs} == {0.0, 0.7}  # greedy and sampled responses
    two = [g for g in groups if sum(s["group"] == g and s["temperature"] == 0 for s in seqs) == 2]
    assert two and all(g in {r["group"] for r in rows if r["turn"] == 2} for g in two)
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 2 and log["num_prompts"] == 8 and log["num_sequences"] == len(seqs)
    assert "Magpie requests kept of 6 wanted" in capsys.readouterr().out


def test_state_shards_and_roundtrip(tmp_path):
    from verispec.spec_decode.dflash_model import DFlashDrafter, new_config
    from verispec.train import state

    model = tiny_model()
    d = DFlashDrafter(new_config(model, "tiny", 4095, block_size=4, num_layers=1))
    d.init_weights(0)
    d.requires_grad_(True)
    opt = torch.optim.AdamW(d.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        sum((p * p).sum() for p in d.parameters()).backward()
        opt.step()
    gen = torch.Generator().manual_seed(5)
    torch.randint(10, (3,), generator=gen)
    limit = 0.02  # MiB: every tensor larger than this is cut into pieces
    size = state.save_state(tmp_path / "st", d, opt, gen, {"x": 1}, shard_mib=limit)
    files = sorted((tmp_path / "st").glob("shard-*.safetensors"))
    assert len(files) > 3 and all(len(load_file(str(f))) >= 1 for f in files)
    assert all(sum(t.numel() * t.element_size() for t in load_file(str(f)).values()) <= limit * 2**20 for f in files)
    assert size == sum(f.stat().st_size for f in (tmp_path / "st").iterdir())
    d2 = DFlashDrafter(d.config)
    d2.init_weights(1)
    d2.requires_grad_(True)
    opt2 = torch.optim.AdamW(d2.parameters(), lr=1e-3)
    gen2 = torch.Generator()
    assert state.load_state(tmp_path / "st", d2, opt2, gen2) == {"x": 1}
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), d2.state_dict().values(), strict=True))
    for p, q in zip(d.parameters(), d2.parameters(), strict=True):
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])
    assert torch.equal(torch.randint(1000, (8,), generator=gen), torch.randint(1000, (8,), generator=gen2))
    half = state.save_state(tmp_path / "st", d, opt, gen, {}, torch.bfloat16, shard_mib=limit)
    assert half < 0.75 * size and not (tmp_path / "st.tmp").exists() and not (tmp_path / "st.old").exists()


def test_stopped_and_resumed_run_equals_uninterrupted(tmp_path, capsys):
    from verispec.entrypoints.cli import build_parser, dispatch
    from verispec.train.cli import cmd_train_drafter

    model = tiny_model()
    vocab = model.config.vocab_size
    rng = torch.Generator().manual_seed(0)
    seqs = [tdata.Seq(torch.randint(100, vocab, (6,), generator=rng).tolist(),
                      torch.randint(100, vocab, (10,), generator=rng).tolist(), g, 0.0) for g in range(8)]

    def main(out: Path, *extra: str) -> dict:
        argv = ["train-drafter", "--target", "tiny", "--out", str(out), "--minutes", "30", "--device", "cpu",
                "--batch-seqs", "3", "--anchors", "3", "--block-size", "4", "--layers", "1", "--warmup", "2",
                "--max-steps", "6", "--save-dtype", "float32", "--log-every", "1", *extra]
        args = build_parser().parse_args(argv)
        assert dispatch(args, lambda a: cmd_train_drafter(a, engine_factory=lambda o: tiny_engine(model))) == 0
        return json.loads((out / "train_log.json").read_text())

    from verispec.spec_decode.dflash_model import new_config
    from verispec.train.data import pick_mask_token

    eng = tiny_engine(model)
    fp = new_config(model, "tiny", pick_mask_token(eng.tokenizer, vocab), 4, 1).target_fingerprint["sha256"]
    for d in ("whole", "split"):
        (tmp_path / d).mkdir()
        tdata.save_sequences(tmp_path / d / "sequences.jsonl", seqs, fp)
    whole = main(tmp_path / "whole", "--sequences", str(tmp_path / "whole" / "sequences.jsonl"), "--save-state")
    part = main(tmp_path / "split", "--sequences", str(tmp_path / "split" / "sequences.jsonl"), "--save-state",
                "--stop-after-steps", "4")
    assert part["steps"] == 4 and not part["complete"] and whole["complete"]
    mid = load_file(str(tmp_path / "split" / "model.safetensors"))
    capsys.readouterr()
    rest = main(tmp_path / "split", "--resume", "--save-state")  # its own sequences.jsonl, no generation
    assert "8 sequences read from" in capsys.readouterr().out
    assert rest["steps"] == 6 and rest["resumed_from_step"] == 4 and rest["complete"]
    a, b = load_file(str(tmp_path / "whole" / "model.safetensors")), load_file(str(tmp_path / "split" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa = {f.name: load_file(str(f)) for f in (tmp_path / "whole" / "train_state").glob("*.safetensors")}
    sb = {f.name: load_file(str(f)) for f in (tmp_path / "split" / "train_state").glob("*.safetensors")}
    assert sa.keys() == sb.keys() and all(torch.equal(sa[f][k], sb[f][k]) for f in sa for k in sa[f])
    assert rest["final_loss"] == whole["final_loss"]
    assert not all(torch.equal(a[k], mid[k]) for k in a)  # 2 steps short of it differs: the test can fail


def _tiny_run(tmp_path: Path, name: str, *extra: str) -> dict:
    """train-drafter on 8 fixed random sequences (tiny target, no generation); its train_log.json."""
    from verispec.entrypoints.cli import build_parser, dispatch
    from verispec.spec_decode.dflash_model import new_config
    from verispec.train.cli import cmd_train_drafter
    from verispec.train.data import pick_mask_token

    model = tiny_model()
    vocab = model.config.vocab_size
    rng = torch.Generator().manual_seed(0)
    seqs = [tdata.Seq(torch.randint(100, vocab, (6,), generator=rng).tolist(),
                      torch.randint(100, vocab, (10,), generator=rng).tolist(), g, 0.0) for g in range(8)]
    eng = tiny_engine(model)
    fp = new_config(model, "tiny", pick_mask_token(eng.tokenizer, vocab), 4, 1).target_fingerprint["sha256"]
    out = tmp_path / name
    out.mkdir()
    tdata.save_sequences(out / "sequences.jsonl", seqs, fp)
    argv = ["train-drafter", "--target", "tiny", "--out", str(out), "--minutes", "30", "--device", "cpu",
            "--sequences", str(out / "sequences.jsonl"), "--batch-seqs", "3", "--anchors", "3", "--block-size", "4",
            "--layers", "1", "--warmup", "2", "--save-dtype", "float32", *extra]
    args = build_parser().parse_args(argv)
    assert dispatch(args, lambda a: cmd_train_drafter(a, engine_factory=lambda o: tiny_engine(model))) == 0
    return json.loads((out / "train_log.json").read_text())


def test_epoch_cap_ends_training(tmp_path):
    """--max-epochs 2 over the 7 training sequences (one of the 8 prompts is held out) at 3 per batch ends
    after ceil(2 * 7 / 3) = 5 steps, complete, well inside the time budget."""
    log = _tiny_run(tmp_path, "cap", "--max-epochs", "2")
    assert log["num_train_sequences"] == 7 and log["epoch_cap_steps"] == 5
    assert log["steps"] == 5 and log["complete"] and log["epochs"] == round(5 * 3 / 7, 2)


def test_validation_is_checked_every_n_steps(tmp_path):
    """--val-every 2 over 8 steps: validation losses at steps 2, 4, 6 and at the end; the log names the
    lowest and the step whose weights were saved (BestWeights, below, keeps and restores them)."""
    log = _tiny_run(tmp_path, "best", "--val-every", "2", "--max-steps", "8")
    curve = log["val_curve"]
    assert [s for s, _ in curve] == [2, 4, 6, 8]
    losses = [v for _, v in curve]
    assert log["best_val_loss"] == min(losses) and log["saved_step"] == curve[losses.index(min(losses))][0]


def test_best_weights_restore_exactly():
    """BestWeights keeps a copy at its lowest loss and puts exactly those weights back."""
    from verispec.spec_decode.dflash_model import DFlashDrafter, new_config
    from verispec.train.loop import BestWeights
    from verispec.train.options import TrainOptions

    model = tiny_model()
    d = DFlashDrafter(new_config(model, "tiny", 4095, block_size=4, num_layers=1))
    d.init_weights(0)
    rng = torch.Generator().manual_seed(1)
    val = [tdata.Sample(t, model.hidden_features(t[None], d.config.target_layers)[0] if hasattr(model, "hidden_features")
                        else torch.randn(t.numel(), len(d.config.target_layers) * model.config.hidden_size), 4)
           for t in [torch.randint(100, model.config.vocab_size, (12,), generator=rng) for _ in range(3)]]
    best = BestWeights(val, TrainOptions(target="tiny", out="x", batch_seqs=2, anchors=2))
    good = {k: v.clone() for k, v in d.state_dict().items()}
    first = best.check(d, model, 1)
    with torch.no_grad():
        for p in d.parameters():
            p.mul_(40.0)
    assert best.check(d, model, 2) > first and best.step == 1
    assert best.restore(d) and all(torch.equal(good[k], v) for k, v in d.state_dict().items())


@pytest.mark.slow
def test_magpie_on_the_real_05b(tmp_path):
    """The real 0.5B instruct model writes its own requests (CPU, minutes), kept by the filter, varied, none a
    held-out text; a short train-drafter run on them. Turns cut at 32 tokens are kept (on this CPU the 0.5B
    rarely ends a turn that soon: most of its turns run past 64 tokens)."""
    from verispec.entrypoints.cli import build_parser, dispatch
    from verispec.train.cli import cmd_train_drafter, load_engine

    out = tmp_path / "real"
    argv = ["train-drafter", "--target", "qwen2.5-coder-0.5b-instruct", "--out", str(out), "--minutes", "40",
            "--device", "cpu", "--prompt-sources", "magpie", "--num-prompts", "4", "--magpie-max-tokens", "32",
            "--magpie-keep-incomplete",
            "--multi-turn", "0", "--responses-per-prompt", "1", "--max-new-tokens", "16", "--max-num-seqs", "8",
            "--max-prompt-tokens", "256", "--max-steps", "2", "--batch-seqs", "2", "--anchors", "2",
            "--block-size", "4", "--layers", "1", "--save-dtype", "float32"]
    args = build_parser().parse_args(argv)
    assert dispatch(args, lambda a: cmd_train_drafter(a, engine_factory=load_engine)) == 0
    rows = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) >= 2 and len({magpie.normalize(r["text"]) for r in rows}) == len(rows)
    assert all(magpie.looks_like_request(r["text"]) for r in rows)
    assert not {magpie.normalize(r["text"]) for r in rows} & {magpie.normalize(t) for t in HELDOUT}
    assert json.loads((out / "train_log.json").read_text())["steps"] == 2
