"""StructuredOutputsParams (vLLM's name): the one grammar a request's output must follow.

Exactly one constraint kind: a JSON schema (`json`), any JSON object (`json_object`), a regex, an EBNF
grammar (xgrammar's / GBNF syntax, root rule `root`) or a list of choices. `validate()` turns it into an
xgrammar `Grammar` at once, without a tokenizer, so a bad schema, regex or grammar is a ValueError naming
the problem before anything slow happens; the engine compiles that Grammar against its vocabulary later
(worker/grammar.py). xgrammar is imported lazily: a plain install without it still runs unconstrained
generation, and a constrained request then gets a ValueError saying what to install.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# Free whitespace between JSON tokens is capped at this many characters: small models otherwise loop on
# whitespace forever (deep indentation of a pretty-printed document stays well within it).
MAX_JSON_WHITESPACE = 20
_KINDS = ("json", "json_object", "regex", "grammar", "choice")
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest names the problem.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def import_xgrammar() -> Any:
    """The xgrammar module, or a ValueError saying how to get it."""
    try:
        import xgrammar
    except ImportError:
        raise ValueError(
            "structured outputs need the xgrammar package, which is not installed: pip install xgrammar"
        ) from None
    return xgrammar


def xgrammar_message(e: Exception) -> str:
    """An xgrammar error's message without its C++ log prefix."""
    return _LOG_PREFIX.sub("", str(e).strip()).strip()


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output options. json: a JSON schema (dict or JSON text); json_object: any
    JSON object; regex; grammar: EBNF text; choice: the output is one of these strings exactly.
    disable_any_whitespace: JSON without free whitespace between tokens (compact output; else at most
    MAX_JSON_WHITESPACE characters of it between two tokens)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    _compiled: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def kind(self) -> str:
        """The one constraint kind set ('json', 'json_object', 'regex', 'grammar' or 'choice')."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        """Raise ValueError unless exactly one constraint is set and it compiles (xgrammar Grammar)."""
        if self._compiled is not None:
            return
        set_kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "StructuredOutputsParams needs exactly one of json, json_object, regex, grammar, choice; "
                f"got {set_kinds or 'none'}"
            )
        self._compiled = self._build(set_kinds[0])

    def grammar_object(self) -> Any:
        """The checked xgrammar Grammar (built by validate)."""
        self.validate()
        return self._compiled

    def _whitespace(self) -> dict[str, Any]:
        """xgrammar's whitespace options for JSON: compact, or free whitespace up to MAX_JSON_WHITESPACE."""
        if self.disable_any_whitespace:
            return {"any_whitespace": False}
        return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}

    def _build(self, kind: str) -> Any:
        xgr = import_xgrammar()
        where = f"StructuredOutputsParams.{kind}"
        try:
            if kind == "json":
                schema = self.json
                if isinstance(schema, str):
                    try:
                        schema = json.loads(schema)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{where} is not valid JSON: {e}") from None
                if not isinstance(schema, dict):
                    raise ValueError(f"{where} must be a JSON schema object, got {type(schema).__name__}")
                _check_schema(schema, where)
                return xgr.Grammar.from_json_schema(json.dumps(schema), **self._whitespace())
            if kind == "json_object":
                if self.json_object is not True:
                    raise ValueError(f"{where} must be True or None, got {self.json_object!r}")
                # OpenAI's json_object: a JSON object (xgrammar's builtin JSON grammar allows any value).
                return xgr.Grammar.from_json_schema('{"type": "object"}', **self._whitespace())
            if kind == "regex":
                if not isinstance(self.regex, str) or not self.regex:
                    raise ValueError(f"{where} must be a non-empty string, got {self.regex!r}")
                return xgr.Grammar.from_regex(self.regex)
            if kind == "grammar":
                if not isinstance(self.grammar, str) or not self.grammar.strip():
                    raise ValueError(f"{where} must be a non-empty EBNF string, got {self.grammar!r}")
                return xgr.Grammar.from_ebnf(self.grammar)
            choices = self.choice
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError(f"{where} must be a non-empty list of non-empty strings, got {choices!r}")
            # JSON string literals are valid EBNF string literals (same escapes).
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in choices))
        except RuntimeError as e:  # xgrammar's parse / conversion errors
            raise ValueError(f"{where} is invalid: {xgrammar_message(e)}") from None


def _check_schema(schema: dict, where: str) -> None:
    """Check the schema against its JSON Schema metaschema when the jsonschema package is there
    (xgrammar ignores some mistakes, e.g. a 'minimum' that is a string)."""
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "/".join(str(p) for p in e.absolute_path)
        raise ValueError(f"{where} is not a valid JSON schema{f' at {path}' if path else ''}: {e.message}") from None
