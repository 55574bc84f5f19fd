"""The command line's flags: EngineConfig's fields become the engine flags of `generate`, `serve` and `bench`
(one list, with their help and defaults), plus generate's and serve's own; every value is checked while the
command line is parsed, before anything slow is imported or loaded."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from typing import Any

from verispec.config import EngineConfig, SpeculativeConfig
from verispec.sampling_params import SamplingParams

HelpFormatter = argparse.ArgumentDefaultsHelpFormatter  # --help shows every option's default

# generate's own defaults (SamplingParams' are for the API: temperature 1, 16 tokens).
GENERATE_PROMPT = "def fibonacci(n):"
GENERATE_MAX_TOKENS = 128
GENERATE_TEMPERATURE = 0.0
SERVE_HOST = "127.0.0.1"
SERVE_PORT = 8000
SERVE_MAX_QUEUE = 1024
# Largest request body `verispec serve` reads (413 above it): room for a prompt that fills a 128K-token context
# (about 4 bytes a token), far below what would hurt the server; vLLM sets no limit of its own.
SERVE_MAX_REQUEST_BYTES = 8 * 2**20


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (`verispec generate: error: ...`), exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def flag(name: str) -> str:
    """The command-line flag of a config field: max_num_seqs -> --max-num-seqs."""
    return "--" + name.replace("_", "-")


def _checked(parse: Callable[[str], Any], check: Callable[[Any], None], what: str) -> Callable[[str], Any]:
    """An argparse type: parse the text, then check the value; both failures are one-line usage errors."""

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        try:
            check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    convert.__name__ = what  # argparse names the type in some messages
    return convert


def spec_json(text: str | None) -> dict | None:
    """--speculative-config: a JSON object, checked as a SpeculativeConfig (returned as the dict)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    try:
        SpeculativeConfig.from_dict(value)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def engine_fields(command: str) -> list[dataclasses.Field]:
    """EngineConfig's fields that `command` (generate, serve or bench) has flags for."""
    return [f for f in dataclasses.fields(EngineConfig) if command in f.metadata.get("commands", ())]


def add_engine_args(parser: argparse.ArgumentParser, command: str) -> None:
    """Add a flag for every EngineConfig field that `command` takes: its type, default, help and check."""
    group = parser.add_argument_group("engine options (EngineConfig; LLM(...) takes the same names)")
    types = EngineConfig._types()
    for f in engine_fields(command):
        kw: dict[str, Any] = dict(dest=f.name, default=f.default, help=EngineConfig.help_of(f.name))
        allowed = types[f.name]
        if bool in allowed:
            kw["action"] = argparse.BooleanOptionalAction
        elif f.name == "speculative_config":
            kw.update(type=spec_json, metavar="JSON")
        else:
            base = next(t for t in allowed if t is not type(None))
            choices = f.metadata.get("choices")
            if choices:
                kw["metavar"] = "{" + ",".join(str(c) for c in choices if c is not None) + "}"
            kw["type"] = _checked(base, lambda v, n=f.name: EngineConfig.check_field(n, v),
                                  {int: "an integer", float: "a number"}.get(base, "a string"))
        group.add_argument(flag(f.name), **kw)


def engine_config_from_args(args: argparse.Namespace, command: str, **overrides: Any) -> EngineConfig:
    """The EngineConfig of parsed flags (fields without a flag in `command` keep their defaults)."""
    kw = {f.name: getattr(args, f.name) for f in engine_fields(command) if hasattr(args, f.name)}
    if getattr(args, "model_arg", None) is not None:  # `verispec serve MODEL`
        kw["model"] = args.model_arg
    return EngineConfig(**{**kw, **overrides})


def _sampling(name: str, parse: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    return _checked(parse, lambda v: SamplingParams(**{name: v}), what)


def _sampling_default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(SamplingParams) if f.name == name)


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    """`verispec generate`'s flags: the prompt, sampling, --chat, and the engine's."""
    parser.add_argument("prompt", nargs="?", default=None,
                        help=f"the prompt (none: read stdin when it is not a terminal, else {GENERATE_PROMPT!r})")
    parser.add_argument("--max-tokens", type=_sampling("max_tokens", int, "an integer"), default=GENERATE_MAX_TOKENS,
                        help="tokens to generate at most")
    parser.add_argument("--temperature", type=_sampling("temperature", float, "a number"),
                        default=GENERATE_TEMPERATURE, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=_sampling("top_p", float, "a number"), default=_sampling_default("top_p"),
                        help="nucleus sampling: keep the smallest set of tokens with this much probability")
    parser.add_argument("--top-k", type=_sampling("top_k", int, "an integer"), default=_sampling_default("top_k"),
                        help="keep the k most likely tokens (-1: all)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(parser, "generate")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """generate's SamplingParams (its --seed seeds the sampling too)."""
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.seed)


def port(text: str) -> int:
    """A TCP port number, 1 .. 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [1, 65535], got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """`verispec serve`'s flags: MODEL (or --model), where to listen, the API key, and the engine's."""
    parser.add_argument("model_arg", nargs="?", default=None, metavar="MODEL", help="the model (same as --model)")
    parser.add_argument("--host", default=SERVE_HOST, help="address to listen on")
    parser.add_argument("--port", type=port, default=SERVE_PORT, help="TCP port to listen on")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    parser.add_argument("--max-queue", type=positive_int, default=SERVE_MAX_QUEUE,
                        help="waiting requests before new ones get a 503")
    parser.add_argument("--max-request-bytes", type=positive_int, default=SERVE_MAX_REQUEST_BYTES,
                        help="largest request body in bytes; a larger one gets a 413")
    parser.add_argument("--served-model-name", default=None, help="the model's name in the API (None: MODEL)")
    add_engine_args(parser, "serve")
