"""Tokenizer built from a GGUF file's own vocabulary (or a Hugging Face folder), plus chat templates.

Byte-level BPE ('gpt2': Qwen, Llama 3): the GGUF stores the vocabulary, merges and token types as
metadata. We rebuild a ``tokenizers.Tokenizer`` from them: a BPE model, the split regex the model
family was trained with followed by a ByteLevel pre-tokenizer (without its own regex), a ByteLevel
decoder, and the control / user-defined tokens as added tokens so they are matched whole in text.

SentencePiece BPE ('llama' with arch gemma3): the GGUF stores pieces ("▁" for a space), their
scores and <0xNN> byte pieces but no merges. SentencePiece merges the adjacent pair whose merged piece
scores best; Gemma's scores fall with the piece's position, so the merges are rebuilt from the
vocabulary ranked by position (as transformers' GGUF loader does, whose ids the tests compare
against), with byte fallback for text no piece covers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from verispec.loader.gguf import read_metadata

# Split regexes, keyed by llama.cpp's ``tokenizer.ggml.pre`` names.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_SPLITS: dict[str, tuple[str, bool]] = {  # pre name -> (regex, ignore_merges)
    "qwen2": (_QWEN2_SPLIT, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
    "llama3": (_LLAMA3_SPLIT, True),
    "llama-v3": (_LLAMA3_SPLIT, True),
    "llama-bpe": (_LLAMA3_SPLIT, True),
    "smaug-bpe": (_LLAMA3_SPLIT, True),
    "gpt-2": (_GPT2_SPLIT, False),
    "default": (_GPT2_SPLIT, False),
    "smollm": (_GPT2_SPLIT, False),
}
_NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 3, 4, 6
# Texts at least this long are encoded with the GIL released (tokenizers' encode_batch): a long prompt must not
# freeze the other threads (the server's event loop, the engine) while it is tokenized.
_RELEASE_GIL_CHARS = 4096
# llama.cpp splits every digit off first for these (SmolLM2's tokenizer.json: Digits(individual_digits)).
_DIGITS_FIRST = frozenset({"smollm"})
# Texts llama.cpp also treats as end of generation when they are in the vocabulary.
_END_OF_TURN_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
_ROLES = ("system", "user", "assistant", "tool")


class Tokenizer:
    """Encode/decode text and render chat templates for one model."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        max_token_bytes: int | None = None,
        add_bos_token: bool = False,
    ) -> None:
        """max_token_bytes: the most bytes of text one token stands for, when every token stands for its own
        bytes of the text (a byte-level vocabulary without a normalizer); None when that does not hold.
        add_bos_token: encode_prompt() starts a prompt with bos_token_id (Gemma's GGUF asks for it)."""
        self._tok = backend
        self.max_token_bytes = max_token_bytes
        self.add_bos_token = add_bos_token
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos_token_id, eos_token_id, pad_token_id
        self.chat_template = chat_template
        eos = {eos_token_id} if eos_token_id is not None else set()
        eos.update(extra_eos_token_ids)
        for text in _END_OF_TURN_TEXTS:
            tid = backend.token_to_id(text)
            if tid is not None and self._is_special(tid):
                eos.add(tid)
        self.eos_token_ids: set[int] = eos
        self._templates: dict[str, jinja2.Template] = {}

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build the tokenizer described by a GGUF file's ``tokenizer.*`` metadata."""
        meta = read_metadata(path)
        where = os.fspath(path)
        kind = meta.get("tokenizer.ggml.model")
        if kind == "llama" and meta.get("general.architecture") == "gemma3":
            return cls._from_gguf_sentencepiece(meta)
        if kind != "gpt2":
            raise ValueError(
                f"{where}: tokenizer.ggml.model {kind!r} is not supported; verispec reads byte-level BPE ('gpt2')"
            )
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in _SPLITS:
            raise ValueError(f"{where}: pre-tokenizer {pre!r} is not supported; known: {sorted(_SPLITS)}")
        tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
        merges_raw: list[str] = meta.get("tokenizer.ggml.merges") or []
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if not tokens or len(types) != len(tokens):
            raise ValueError(f"{where}: missing or inconsistent tokenizer.ggml.tokens / token_type")
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError(f"{where}: tokenizer.ggml.tokens has duplicate entries")
        merges = []
        for m in merges_raw:
            parts = m.split(" ")
            if len(parts) != 2:
                raise ValueError(f"{where}: malformed merge {m!r}")
            merges.append((parts[0], parts[1]))
        split, ignore_merges = _SPLITS[pre]
        tok = _HFTokenizer(
            models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges, fuse_unk=False)
        )
        digits = [pre_tokenizers.Digits(individual_digits=True)] if pre in _DIGITS_FIRST else []
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                *digits,
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty == _CONTROL
            ]
        )
        tok.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty == _USER_DEFINED
            ]
        )
        bos = meta.get("tokenizer.ggml.bos_token_id")
        if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A",
                pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                special_tokens=[(tokens[bos], bos)],
            )
        return cls(
            tok,
            bos_token_id=bos,
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            chat_template=meta.get("tokenizer.chat_template"),
            # A byte-level spelling has one character per byte; added tokens match their UTF-8 text whole.
            max_token_bytes=max(len(t) if ty in (_NORMAL, _BYTE) else len(t.encode("utf-8"))
                                for t, ty in zip(tokens, types, strict=True)),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None,
        )

    @classmethod
    def _from_gguf_sentencepiece(cls, meta: dict[str, Any]) -> Tokenizer:
        """Gemma's SentencePiece BPE vocabulary (see the module docstring)."""
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        # Runs of two or more spaces are stored as spaces; the model sees them as "▁" runs.
        pieces = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {p: i for i, p in enumerate(pieces)}
        unk_id = meta.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if unk_id is not None else "<unk>"
        tok = _HFTokenizer(models.BPE(vocab=vocab, merges=_merges_by_rank(pieces, vocab), fuse_unk=True,
                                      unk_token=unk, byte_fallback=True))
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL])
        # User-defined pieces ("\n", "\t", "<table>", ...) are matched whole; the respelled space runs go through BPE.
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED and t in vocab])
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eot = tok.token_to_id("<end_of_turn>")
        return cls(
            tok, bos_token_id=bos, eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            extra_eos_token_ids=[eot] if eot is not None else [],
            chat_template=meta.get("tokenizer.chat_template") or GEMMA_CHAT_TEMPLATE,
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", True)) and bos is not None,
        )

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load ``tokenizer.json`` plus the chat template / special tokens of ``tokenizer_config.json``."""
        folder = os.fspath(path)
        tok = _HFTokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        cfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
        gen = _read_json(os.path.join(folder, "generation_config.json"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = os.path.join(folder, "chat_template.jinja")
        if template is None and os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()

        def tid(name: str) -> int | None:
            val = cfg.get(name)
            text = val.get("content") if isinstance(val, dict) else val
            return tok.token_to_id(text) if isinstance(text, str) else None

        gen_eos = gen.get("eos_token_id")
        extra = gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else []
        return cls(
            tok,
            bos_token_id=tid("bos_token"),
            eos_token_id=tid("eos_token"),
            pad_token_id=tid("pad_token"),
            extra_eos_token_ids=[int(i) for i in extra],
            chat_template=template,
        )

    # ------------------------------------------------------------------ encode/decode
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are kept whole."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        if len(text) >= _RELEASE_GIL_CHARS:  # same ids; encode_batch lets other threads run meanwhile
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), found without encoding it: each token stands for at most
        max_token_bytes bytes of the text (0 when the vocabulary gives no such bound)."""
        if not self.max_token_bytes:
            return 0
        return -(-len(text.encode("utf-8", errors="surrogatepass")) // self.max_token_bytes)

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids: encode(text), with the BOS token in front when the model wants one and the
        text (a rendered chat template, say) does not already start with it."""
        ids = self.encode(text)
        if self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """encode() of many texts at once (in parallel threads)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (invalid UTF-8 becomes U+FFFD)."""
        ids = list(ids)
        self._check_ids(ids)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        """Vocabulary spelling of one id or a list of ids."""
        if isinstance(ids, int):
            self._check_ids([ids])
            return self._tok.id_to_token(ids)
        ids = list(ids)
        self._check_ids(ids)
        return [self._tok.id_to_token(i) for i in ids]

    def grammar_vocab(self) -> list[str]:
        """Every id's byte-level spelling, with "" for special tokens (never text): the vocabulary a
        grammar matcher walks (xgrammar's BYTE_LEVEL encoding)."""
        special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        return ["" if i in special else (self._tok.id_to_token(i) or "") for i in range(self.vocab_size)]

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary spelling, or None."""
        return self._tok.token_to_id(token)

    def _check_ids(self, ids: list[int]) -> None:
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i!r} is out of range [0, {self.vocab_size})")

    def _is_special(self, tid: int) -> bool:
        added = self._tok.get_added_tokens_decoder().get(tid)
        return added is not None and added.special

    # ----------------------------------------------------------------- chat template
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
    ) -> str:
        """Render a conversation with the model's chat template in a sandboxed jinja2 environment."""
        _validate_messages(messages)
        if tools is not None and (
            not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise ValueError("tools must be a list of objects")
        source = chat_template if chat_template is not None else self.chat_template
        if not source:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        if source not in self._templates:
            try:
                self._templates[source] = _jinja_env().from_string(source)
            except jinja2.TemplateError as e:
                raise ValueError(f"chat template does not compile: {e}") from None
        names = {
            "bos_token": self.bos_token_id,
            "eos_token": self.eos_token_id,
            "pad_token": self.pad_token_id,
        }
        specials = {k: self._tok.id_to_token(v) for k, v in names.items() if v is not None}
        try:
            return self._templates[source].render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **specials
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from None


def _merges_by_rank(pieces: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, best first: a merge ranks by its
    merged piece's position, then by the longer left and right parts (transformers' generate_merges
    with position scores)."""
    found: list[tuple[int, int, int, str, str]] = []
    for piece, rank in vocab.items():
        local = [(vocab[piece[:i]], vocab[piece[i:]], piece[:i], piece[i:]) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        local.sort()
        found += [(-rank, len(left), len(right), left, right) for _, _, left, right in local]
    found.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)  # stable: ties keep the order above
    return [(m[3], m[4]) for m in found]


# Gemma 3's chat template (its tokenizer_config.json; the GGUF carries none): "model" is the assistant
# role, a system message is folded into the first user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(_ROLES)}, got {role!r}")
        content = m.get("content")
        calls = m.get("tool_calls")
        if calls is not None and (role != "assistant" or not isinstance(calls, list)):
            raise ValueError(f"messages[{i}].tool_calls must be a list on an assistant message")
        if content is None and role == "assistant" and calls:
            continue  # an assistant turn that only calls tools
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}")


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    """JSON without HTML escaping (jinja's own tojson escapes <, >, & and ')."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], autoescape=False
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
