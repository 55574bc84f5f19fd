"""quantization="gguf" through the loader and the engine on tiny models (fast, CPU): a quantized Llama GGUF
(q/k rows permuted as llama.cpp writes them, tied and untied heads) against its own dequantized load, the
CUDA wiring's segment grouping with stand-in kernels, and the errors a bad request gets."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType
from llama_gguf import tiny_llama, write_llama_gguf

from verispec.loader import quantized
from verispec.loader.dequant import dequantize
from verispec.models.layers.quant import DenseSegment, GGUFSegment, QuantEmbedding, QuantLinear, weight_nbytes

T = GGMLQuantizationType
VOCAB = 300


@pytest.fixture(scope="module", params=[("q8_0", False), ("q5_0", True)], ids=["q8_0", "q5_0-tied"])
def tiny_gguf(request, tmp_path_factory):
    outtype, tie = request.param
    path = tmp_path_factory.mktemp(f"q-{outtype}") / f"tiny-llama-{outtype}.gguf"
    write_llama_gguf(tiny_llama(VOCAB, seed=2, tie=tie), path, outtype)
    return path


def _load(path, quantization):
    from verispec.loader.model_loader import load_model

    return load_model(str(path), torch.device("cpu"), torch.float32, progress=False, quantization=quantization)


def test_quantized_llama_matches_its_dequantized_load(tiny_gguf, monkeypatch, tmp_path):
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path))  # the dequantized load writes its cache here
    _, cfg, ref = _load(tiny_gguf, "none")
    _, _, q = _load(tiny_gguf, "gguf")
    kinds = [type(m) for m in q.modules()]
    assert kinds.count(QuantLinear) == 4 * cfg.num_layers + 1 and QuantEmbedding in kinds
    assert weight_nbytes(q) < weight_nbytes(ref) / 2
    ids = torch.tensor([3, 17, 42, 99, 5, 250])
    torch.testing.assert_close(q.embed(ids), ref.embed(ids), rtol=0, atol=0)  # embedding rows bit-exact
    x = torch.randn(4, cfg.hidden_size)
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj"):
        lq, lr = q.get_submodule(f"model.layers.1.{name}"), ref.get_submodule(f"model.layers.1.{name}")
        want = F.linear(x, lr.weight, lr.bias)
        bound = 4 * 2.0**-8 * (x.abs() @ lr.weight.abs().t())
        assert ((lq(x) - want).abs() <= bound).all(), name  # rows unpermuted like the dense load's
    h = torch.randn(3, cfg.hidden_size)
    lr, lq = ref.compute_logits(h), q.compute_logits(h)
    assert lq.dtype == torch.float32 and ((lq - lr).abs() <= 4 * 2.0**-8 * (h.abs() @ ref.lm_head_weight.abs().t())).all()


def test_engine_generates_with_the_quantized_tiny_model(tiny_gguf, monkeypatch, tmp_path):
    from verispec import LLM, SamplingParams

    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path))
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    q = LLM(str(tiny_gguf), device="cpu", max_model_len=128, num_gpu_blocks=32)  # the default on CPU
    ref = LLM(str(tiny_gguf), device="cpu", quantization="none", max_model_len=128, num_gpu_blocks=32)
    assert q.config.quantization == "gguf" and ref.config.quantization == "none"
    prompt = [[5, 9, 30, 31, 7]]
    a = q.generate(prompt_token_ids=prompt, sampling_params=sp, use_tqdm=False)[0].outputs[0].token_ids
    b = ref.generate(prompt_token_ids=prompt, sampling_params=sp, use_tqdm=False)[0].outputs[0].token_ids
    assert len(a) == len(b) == 12
    assert a[:3] == b[:3], (a, b)  # tiny random model: the first greedy tokens agree, later ones may drift


def test_self_speculation_on_the_quantized_model_is_lossless(tiny_gguf, monkeypatch, tmp_path):
    """torch's CPU int4 matmul gives a row the same result whatever the row count, so the self oracle on the
    quantized model accepts every draft and returns plain decoding's tokens."""
    from verispec import LLM, SamplingParams

    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path))
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[5, 9, 30, 31, 7], [100, 4, 4, 250]]
    kw = dict(device="cpu", quantization="gguf", max_model_len=128, num_gpu_blocks=64)
    plain = LLM(str(tiny_gguf), **kw).generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    spec = LLM(str(tiny_gguf), **kw, speculative_config={"method": "self", "num_speculative_tokens": 3,
                                                        "adaptive": False})
    outs = spec.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    m = spec.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0
    assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"]


@dataclass(frozen=True)
class FakeGGUFWeight:
    """Stands in for kernels.gguf_matmul.GGUFWeight: the types its kernels would take, checked the same way."""

    blocks: torch.Tensor
    qtype: int
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        if self.qtype not in (T.Q5_0, T.Q8_0):
            raise ValueError(f"no kernel for {self.qtype}")


def fake_gguf_linear(x, w: FakeGGUFWeight, bias=None):
    return F.linear(x, dequantize(w.blocks.reshape(-1), w.qtype, w.shape).to(x.dtype), bias)


def test_cuda_segments_group_runs_of_one_type():
    """Q5_0, Q5_0 -> one stacked GGUFWeight; Q6_K (no kernel) -> dense; Q8_0 -> its own GGUFWeight."""
    from collections import Counter

    from test_cpu_pack import _raw

    parts = [(T.Q5_0, 16), (T.Q5_0, 32), (T.Q6_K, 16), (T.Q8_0, 8)]
    tensors = [(_raw(t, n, 256, seed=i, sane=True), int(t), (n, 256)) for i, (t, n) in enumerate(parts)]
    held: Counter = Counter()
    segs = quantized._cuda_segments(tensors, torch.device("cpu"), torch.float32, held,
                                    kernels=(FakeGGUFWeight, fake_gguf_linear))
    assert [type(s) for s in segs] == [GGUFSegment, DenseSegment, GGUFSegment]
    assert segs[0].weight.shape == (48, 256) and segs[0].weight.qtype == T.Q5_0 and segs[2].weight.shape == (8, 256)
    assert held == Counter({"Q5_0: GGUF blocks": 2, "Q6_K: float32": 1, "Q8_0: GGUF blocks": 1})
    lin = QuantLinear(segs, None, torch.float32)
    w = torch.cat([dequantize(raw, t, shape) for raw, t, shape in tensors])
    x = torch.randn(3, 256)
    torch.testing.assert_close(lin(x), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_cuda_path_without_the_kernel_module_is_a_clear_error():
    if importlib.util.find_spec("verispec.kernels.gguf_matmul") is None:
        with pytest.raises(ValueError, match="gguf_matmul"):
            quantized._gguf_kernels()
    else:
        weight_cls, linear = quantized._gguf_kernels()
        assert weight_cls.__name__ == "GGUFWeight" and callable(linear)


def test_gguf_on_a_folder_or_a_bad_name_is_a_value_error(tmp_path):
    from verispec.loader.model_loader import load_model

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="needs a .gguf model"):
        load_model(str(tmp_path), torch.device("cpu"), torch.float32, progress=False, quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(str(tmp_path), torch.device("cpu"), torch.float32, progress=False, quantization="awq")


def test_kernel_segments_write_one_output_with_the_bias_and_fuse_silu_mul():
    """All-GGUF segments (the CUDA path; here gguf_linear's CPU reference): forward writes each segment's
    columns of one output with its part of the bias, and silu_mul on one [gate; up] segment is the
    unfused silu(gate) * up."""
    gm = pytest.importorskip("verispec.kernels.gguf_matmul")
    q, v = gm.random_weight(int(T.Q4_K), 24, 256, seed=1), gm.random_weight(int(T.Q6_K), 9, 256, seed=2)
    bias = torch.randn(33)
    seg = dict(matmul=gm.gguf_linear, epilogues=True)
    lin = QuantLinear([GGUFSegment(q, **seg), GGUFSegment(v, **seg)], bias, torch.float32)
    assert lin.kernel_segments
    x = torch.randn(3, 256)
    dense = torch.cat([q.dequantize(), v.dequantize()])
    torch.testing.assert_close(lin(x), x @ dense.t() + bias, rtol=1e-5, atol=1e-5)
    gu = gm.random_weight(int(T.Q4_K), 2 * 21, 256, seed=3)
    mlp_in = QuantLinear([GGUFSegment(gu, **seg)], None, torch.float32)
    xs = torch.randn(4, 256) * 0.05
    gate, up = (xs @ gu.dequantize().t()).chunk(2, dim=-1)
    torch.testing.assert_close(mlp_in.silu_mul(xs), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_kernel_segments_pass_the_models_kernel_options():
    """enable_triton's options reach the GGUF kernels (batch_invariant picks one kernel for every row count
    there): a QuantLinear switched on hands kernels.options to each segment's matmul."""
    gm = pytest.importorskip("verispec.kernels.gguf_matmul")
    from verispec.core.options import KernelOptions
    from verispec.models.kernel_path import Kernels

    seen = []

    def matmul(x, w, bias=None, options=None, out=None, silu_mul=False):
        seen.append(options)
        return gm.gguf_linear(x, w, bias, out=out, silu_mul=silu_mul)

    q = gm.random_weight(int(T.Q4_K), 8, 256, seed=1)
    lin = QuantLinear([GGUFSegment(q, matmul, epilogues=True)], None, torch.float32)
    lin(torch.randn(2, 256))
    lin.kernels = Kernels(KernelOptions(batch_invariant=True))
    lin(torch.randn(2, 256))
    assert seen[0] is None and seen[1].batch_invariant
