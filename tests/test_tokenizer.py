"""The GGUF tokenizer against transformers' GGUF tokenizer, computed at test time."""

from __future__ import annotations

import random

import pytest

from verispec.loader.tokenizer import Tokenizer

CORPUS = [
    "Hello, world!",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    '#include <stdio.h>\nint main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}\n',
    "const f = async (x) => { await fetch(`/api/${x}`); };  // JS\r\n",
    "你好，世界！日本語のテキスト。한국어 텍스트",
    "emoji 😀👍🏽 👨‍👩‍👧‍👦 🇯🇵 flags and ZWJ",
    "combining: e\u0301 a\u0308 n\u0303 vs é ä ñ",
    "RTL: שלום עולם مرحبا بالعالم",
    "spaces:" + " " * 37 + "end\t\t\ttabs\n\n\n\nnewlines \n \n",
    "   leading and trailing   ",
    "numbers 1234567890 3.14159 -2e10 0xFF 1,000,000",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    'call <tool_call>\n{"name": "f"}\n</tool_call> done',
    "not special: <|im_start and im_end|> <|unknown|>",
    "I'm sure they'll say it's 'quoted' THEY'RE",
    "",
    "\n",
    "x" * 300,
    "Mixed\u00a0nbsp\u2003em-space\u200bzwsp",
]


@pytest.fixture(scope="module")
def tok(qwen05_path) -> Tokenizer:
    return Tokenizer.from_gguf(qwen05_path)


@pytest.fixture(scope="module")
def hf(qwen05_path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(qwen05_path.parent, gguf_file=qwen05_path.name)


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_transformers(tok: Tokenizer, hf, text: str) -> None:
    expected = hf.encode(text, add_special_tokens=False)
    assert tok.encode(text) == expected
    assert tok.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("text", CORPUS)
def test_decode_round_trip(tok: Tokenizer, hf, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_random_ids_decode_like_transformers(tok: Tokenizer, hf) -> None:
    rng = random.Random(1234)
    specials = sorted(tok.eos_token_ids) + [tok.token_to_id("<|im_start|>"), tok.token_to_id("<tool_call>")]
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))] + rng.sample(specials, 2)
        rng.shuffle(ids)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_special_token_ids(tok: Tokenizer, hf) -> None:
    assert tok.vocab_size == len(hf)
    assert tok.eos_token_id == hf.eos_token_id
    assert tok.bos_token_id == hf.bos_token_id
    assert tok.pad_token_id == hf.pad_token_id
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    endoftext = hf.convert_tokens_to_ids("<|endoftext|>")
    assert {im_end, endoftext} <= tok.eos_token_ids
    assert tok.convert_ids_to_tokens(im_end) == "<|im_end|>"


def test_decode_rejects_bad_ids(tok: Tokenizer) -> None:
    for bad in ([tok.vocab_size], [-1], ["a"]):
        with pytest.raises(ValueError):
            tok.decode(bad)


CONVERSATIONS = [
    [{"role": "user", "content": "Write a haiku about tokens."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": 'And 日本 <tags> & "quotes"?'},
    ],
    [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get", "arguments": {"city": "Zürich"}}}
            ],
        },
        {"role": "tool", "content": '{"temp": 3}'},
        {"role": "tool", "content": "sunny"},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "get", "description": "<weather> & co", "parameters": {}}}]


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_matches_transformers(tok: Tokenizer, hf, conv: int, gen: bool, tools) -> None:
    messages = CONVERSATIONS[conv]
    expected = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)
    assert tok.apply_chat_template(messages, add_generation_prompt=gen, tools=tools) == expected


def test_from_hf_folder_matches(tok: Tokenizer, hf, tmp_path_factory) -> None:
    folder = tmp_path_factory.mktemp("hf_tok")
    hf.save_pretrained(folder)
    other = Tokenizer.from_hf_folder(folder)
    for text in CORPUS:
        assert other.encode(text) == tok.encode(text)
    assert other.eos_token_id == tok.eos_token_id
    assert tok.eos_token_ids <= other.eos_token_ids
    assert other.apply_chat_template(CONVERSATIONS[1]) == tok.apply_chat_template(CONVERSATIONS[1])


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"role": "user"}],
        [{"role": "robot", "content": "hi"}],
        [{"role": 3, "content": "hi"}],
        [{"content": "hi"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": None}],
        ["user: hi"],
        [{"role": "user", "content": "hi"}, None],
        [{"role": "user", "content": "hi", "tool_calls": [{}]}],
    ],
)
def test_bad_messages_raise(tok: Tokenizer, messages) -> None:
    with pytest.raises(ValueError):
        tok.apply_chat_template(messages)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__['os'].system('echo pwned') }}",
        "{{ messages.append({'role': 'user', 'content': 'x'}) }}",
        "{{ messages[0].update({'role': 'system'}) }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ raise_exception('template says no') }}",
        "{% for m in messages %}{{ m.content.__len__ }}",  # does not even compile
    ],
)
def test_sandbox_refuses(tok: Tokenizer, template: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError):
        tok.apply_chat_template(messages, chat_template=template)
    assert messages == [{"role": "user", "content": "hi"}]


def test_sandbox_hides_dunder_attributes(tok: Tokenizer) -> None:
    out = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], chat_template="[{{ messages.__class__ }}][{{ tojson }}]{{ 1 }}"
    )
    assert out == "[][]1"


def test_template_features(tok: Tokenizer) -> None:
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m | tojson }}\n{% endfor %}{{ bos_token }}|{{ eos_token }}"
    )
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "<b>é</b>"},
        {"role": "assistant", "content": "c"},
    ]
    out = tok.apply_chat_template(messages, chat_template=template)
    bos, eos = tok.convert_ids_to_tokens([tok.bos_token_id, tok.eos_token_id])
    assert out == f'{{"role": "user", "content": "<b>é</b>"}}\n{bos}|{eos}'


# Whitespace-sensitive on purpose: block tags on their own indented lines (trim_blocks/lstrip_blocks).
CUSTOM_TEMPLATE = """{% for m in messages %}
  {% if m.role == 'system' %}
    [SYS] {{ m.content }}
  {% else %}
{{ m.role | upper }}: {{ m.content | trim }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}
ASSISTANT:{% endif %}
{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"""


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_custom_template_whitespace_matches_transformers(tok: Tokenizer, hf, tools) -> None:
    messages = CONVERSATIONS[1]
    for gen in (True, False):
        expected = hf.apply_chat_template(
            messages, chat_template=CUSTOM_TEMPLATE, tools=tools, add_generation_prompt=gen, tokenize=False
        )
        got = tok.apply_chat_template(
            messages, add_generation_prompt=gen, tools=tools, chat_template=CUSTOM_TEMPLATE
        )
        assert got == expected
