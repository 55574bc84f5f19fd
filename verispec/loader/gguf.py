"""Reading GGUF files: metadata, model config and memory-mapped tensor bytes.

A small self-contained parser (GGUF v2/v3, little-endian). Large metadata arrays such as the
tokenizer's tokens and merges are decoded in one pass; numeric arrays go through numpy.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from verispec.config import ARCHITECTURES, ModelConfig

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# GGUF value type id -> (struct format, numpy dtype) for scalar types.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
    4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "<u1"),
    10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_STRING, _ARRAY, _BOOL, _FLOAT32 = 8, 9, 7, 6
SUPPORTED_ARCHS = ARCHITECTURES
_U64 = struct.Struct("<Q")
# Parsed headers (version, metadata, data offset, tensors) by (path, size, mtime_ns): read-only.
_PARSED: dict[tuple[str, int, int], tuple[int, dict[str, Any], int, dict[str, Any]]] = {}


class GGUFError(ValueError):
    """A GGUF file is malformed, truncated or not something verispec can load."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's directory entry: torch-order shape and absolute byte range in the file."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        """Name of the ggml type, e.g. ``Q4_K``."""
        return GGMLQuantizationType(self.ggml_type).name


class _Cursor:
    """Bounds-checked little-endian reader over a buffer; errors name the file."""

    def __init__(self, buf: Any, path: str) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(
                f"{self.path}: truncated header while reading {what}: needs {n} bytes at offset "
                f"{self.pos}, but the file has {self.size} bytes"
            )

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8 ({e})") from None

    def strings(self, count: int, what: str) -> list[str]:
        """An array of count strings (the tokenizer's 150k tokens and merges): one tight loop."""
        self.need(count * 8, what)  # every string needs at least its length prefix
        buf, pos, size, read = self.buf, self.pos, self.size, _U64.unpack_from
        raw = []
        for _ in range(count):
            end = pos + 8 + read(buf, pos)[0] if pos + 8 <= size else size + 1
            if end > size:
                self.pos = pos
                self.string(what)  # raises the truncation error
            raw.append(buf[pos + 8 : end])
            pos = end
        self.pos = pos
        try:
            return [r.decode("utf-8") for r in raw]
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8 ({e})") from None

    def value(self, vtype: int, what: str) -> Any:
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            itype = self.unpack("<I", what)
            count = self.unpack("<Q", what)
            return self.array(itype, count, what)
        if vtype not in _SCALARS:
            raise GGUFError(f"{self.path}: unknown metadata value type {vtype} in {what}")
        v = self.unpack(_SCALARS[vtype][0], what)
        if vtype == _FLOAT32:  # shortest decimal that round-trips in float32: 1e-06, not 9.99999997e-07
            return float(repr(np.float32(v)).removeprefix("np.float32(").removesuffix(")"))
        return bool(v) if vtype == _BOOL else v

    def array(self, itype: int, count: int, what: str) -> list[Any]:
        if itype in _SCALARS:
            dt = np.dtype(_SCALARS[itype][1])
            self.need(count * dt.itemsize, what)
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
            self.pos += count * dt.itemsize
            return arr.astype(bool).tolist() if itype == _BOOL else arr.tolist()
        if itype == _STRING:
            return self.strings(count, what)
        if itype == _ARRAY:
            self.need(count * 12, what)
            out = []
            for _ in range(count):
                sub = self.unpack("<I", what)
                out.append(self.array(sub, self.unpack("<Q", what), what))
            return out
        raise GGUFError(f"{self.path}: unknown array element type {itype} in {what}")


class GGUFFile:
    """An opened GGUF file: ``metadata`` (plain python values) and ``tensors`` (name -> info).

    Tensor bytes are served from a read-only-by-convention copy-on-write memory map.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Parse the header, or reuse the parse of the same file (path, size, mtime) from one of
        the last two opened: loading weights and building the tokenizer both read it."""
        self.path = os.fspath(path)
        self._data: np.ndarray | None = None
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                self.file_size = st.st_size
                if self.file_size == 0:
                    raise GGUFError(f"{self.path}: empty file, not a GGUF model")
                key = (os.path.abspath(self.path), st.st_size, st.st_mtime_ns)
                if key in _PARSED:
                    self.version, self.metadata, self.data_offset, self.tensors = _PARSED[key]
                    return
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open GGUF file ({e.strerror or e})") from None
        try:
            self._parse(_Cursor(buf, self.path))
        finally:
            buf.close()
        while len(_PARSED) >= 2:
            del _PARSED[next(iter(_PARSED))]
        _PARSED[key] = (self.version, self.metadata, self.data_offset, self.tensors)

    def _parse(self, c: _Cursor) -> None:
        c.need(4, "magic")
        magic = bytes(c.buf[0:4])
        if magic != _MAGIC:
            raise GGUFError(f"{self.path}: bad magic {magic!r}, expected {_MAGIC!r}; not a GGUF file")
        c.pos = 4
        self.version = c.unpack("<I", "version")
        if self.version not in _SUPPORTED_VERSIONS:
            hint = " (big-endian GGUF files are not supported)" if self.version & 0xFFFF == 0 else ""
            raise GGUFError(
                f"{self.path}: unsupported GGUF version {self.version}{hint}; supported: {_SUPPORTED_VERSIONS}"
            )
        n_tensors = c.unpack("<Q", "tensor count")
        n_kv = c.unpack("<Q", "metadata count")
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}")
            vtype = c.unpack("<I", f"type of metadata {key!r}")
            self.metadata[key] = c.value(vtype, f"metadata {key!r}")
        entries = []
        for i in range(n_tensors):
            name = c.string(f"tensor name #{i}")
            n_dims = c.unpack("<I", f"tensor {name!r} rank")
            if n_dims > 8:
                raise GGUFError(f"{self.path}: tensor {name!r} has implausible rank {n_dims}")
            dims = [c.unpack("<Q", f"tensor {name!r} dims") for _ in range(n_dims)]
            gtype = c.unpack("<I", f"tensor {name!r} type")
            offset = c.unpack("<Q", f"tensor {name!r} offset")
            entries.append((name, dims, gtype, offset))
        align = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise GGUFError(f"{self.path}: general.alignment must be a power of two, got {align!r}")
        self.data_offset = -(-c.pos // align) * align
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, gtype, offset in entries:
            self.tensors[name] = self._tensor_info(name, dims, gtype, offset)

    def _tensor_info(self, name: str, dims: list[int], gtype: int, offset: int) -> GGUFTensorInfo:
        try:
            qtype = GGMLQuantizationType(gtype)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFError(f"{self.path}: tensor {name!r} has unknown ggml tensor type id {gtype}") from None
        if name in self.tensors:
            raise GGUFError(f"{self.path}: duplicate tensor {name!r}")
        n = int(np.prod(dims, dtype=np.int64)) if dims else 1
        if dims and dims[0] % block:
            raise GGUFError(
                f"{self.path}: tensor {name!r} row length {dims[0]} is not a multiple of the "
                f"{qtype.name} block size {block}"
            )
        nbytes = n // block * type_size
        start = self.data_offset + offset
        if start + nbytes > self.file_size:
            raise GGUFError(
                f"{self.path}: truncated tensor data: tensor {name!r} needs bytes [{start}, {start + nbytes}) "
                f"but the file has only {self.file_size} bytes"
            )
        return GGUFTensorInfo(name, int(qtype), tuple(int(d) for d in reversed(dims)), start, nbytes)

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a flat uint8 CPU tensor backed by the memory map (no copy)."""
        info = self.tensor(name)
        if self._data is None:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="c")
        return torch.from_numpy(self._data[info.offset : info.offset + info.nbytes])

    def tensor(self, name: str) -> GGUFTensorInfo:
        """Directory entry of tensor ``name``; GGUFError if the file has no such tensor."""
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: missing tensor {name!r}")
        return self.tensors[name]

    def close(self) -> None:
        """Drop the memory map (tensors created by ``raw`` keep their own reference)."""
        self._data = None


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """All metadata key/values of a GGUF file as plain python values (str, int, float, bool, lists)."""
    return GGUFFile(path).metadata


def _req(meta: dict[str, Any], key: str, where: str) -> Any:
    if key not in meta:
        raise GGUFError(f"{where}: missing required metadata key {key!r}")
    return meta[key]


def model_config_from_metadata(
    meta: dict[str, Any], name: str = "", *, tensor_names: Collection[str] | None = None, source: str = ""
) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (archs qwen2, llama, qwen3, gemma3).

    With ``tensor_names`` (the file's tensors), embeddings are tied iff there is no ``output.weight``
    and qkv bias / q-k norm follow the layer-0 tensors; without it, tied embeddings and the arch's
    defaults are assumed. ``source`` names the file in error messages.
    """
    where = source or name or "GGUF metadata"
    arch = _req(meta, "general.architecture", where)
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"{where}: unsupported architecture {arch!r}; verispec runs {', '.join(SUPPORTED_ARCHS)}")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or (tensor_names is not None and "rope_freqs.weight" in tensor_names):
        what = f"rope scaling {scaling!r}" if scaling != "none" else "rope_freqs.weight (Llama 3.1-style rope scaling)"
        raise GGUFError(f"{where}: {what} is not supported: verispec's plain rotary embedding would give wrong outputs")
    hidden = int(_req(meta, f"{arch}.embedding_length", where))
    heads = int(_req(meta, f"{arch}.attention.head_count", where))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else meta.get(f"{arch}.vocab_size")
    if vocab is None:
        raise GGUFError(f"{where}: missing required metadata key 'tokenizer.ggml.tokens' (for the vocab size)")
    kw: dict[str, Any] = dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_req(meta, f"{arch}.feed_forward_length", where)),
        num_layers=int(_req(meta, f"{arch}.block_count", where)),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        name=name or str(meta.get("general.name", "")),
    )
    opt = {
        "rope_theta": f"{arch}.rope.freq_base",
        "rms_norm_eps": f"{arch}.attention.layer_norm_rms_epsilon",
        "max_position_embeddings": f"{arch}.context_length",
    }
    for field_name, key in opt.items():
        if key in meta:
            kw[field_name] = meta[key]
    kw["max_position_embeddings"] = int(kw.get("max_position_embeddings", 32768))
    kw["tie_word_embeddings"] = tensor_names is None or "output.weight" not in tensor_names
    if tensor_names is not None:
        kw["qkv_bias"] = "blk.0.attn_q.bias" in tensor_names
        kw["qk_norm"] = "blk.0.attn_q_norm.weight" in tensor_names
    if arch == "gemma3":
        kw.update(_gemma3_options(meta, where))
    return ModelConfig.for_arch(arch, **kw)


def _gemma3_options(meta: dict[str, Any], where: str) -> dict[str, Any]:
    """Gemma 3's extra keys. llama.cpp writes no pattern, local rope base nor query scalar for Gemma 3
    (it hard-codes them: every 6th layer global, local base 10000, scale head_dim ** -0.5), and
    transformers' GGUF loader assumes the same defaults."""
    if meta.get("gemma3.attn_logit_softcapping") is not None:
        raise GGUFError(f"{where}: attention logit softcapping is not supported")
    out: dict[str, Any] = {"sliding_window": int(_req(meta, "gemma3.attention.sliding_window", where))}
    cap = meta.get("gemma3.final_logit_softcapping")
    out["final_logit_softcapping"] = float(cap) if cap else None
    if "gemma3.rope.scaling.factor" in meta or "gemma3.rope.scaling.type" in meta:
        raise GGUFError(f"{where}: rope scaling is not supported for gemma3")
    return out


def read_model_config(path: str | os.PathLike[str], name: str = "") -> ModelConfig:
    """ModelConfig of a GGUF file; embeddings are tied when the file has no ``output.weight``."""
    f = GGUFFile(path)
    return model_config_from_metadata(f.metadata, name, tensor_names=f.tensors.keys(), source=f.path)
