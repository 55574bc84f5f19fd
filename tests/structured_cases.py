"""Constraints for the structured-output tests: JSON schemas, regexes, choices and an EBNF grammar,
each with an independent check of an output (jsonschema, re.fullmatch, membership, a parser)."""

from __future__ import annotations

import json
import re

import jsonschema

SHORT = {"type": "string", "maxLength": 6}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"],
     "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                      "note": SHORT}, "required": ["id"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0, "maximum": 3}},
     "required": ["status", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": SHORT, "roles": {"type": "array", "items": {"enum": ["admin", "dev"]}, "maxItems": 2}},
        "required": ["name", "roles"], "additionalProperties": False}}, "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["level"],
     "additionalProperties": False},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}, "required": ["v"],
     "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"enum": ["x", "y"]}}, "required": ["c"], "additionalProperties": False}}, "required": ["b"],
        "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"first": SHORT, "last": SHORT, "middle": SHORT}, "required": ["first", "last"],
     "additionalProperties": False},
    {"type": "object", "properties": {"pair": {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": ["p", "q"]}],
                                               "items": False, "minItems": 2}}, "required": ["pair"],
     "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0,
                                                                                "maximum": 4}},
     "required": ["kind", "legs"], "additionalProperties": False},
    {"type": "object", "properties": {"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}, "required": ["hex"],
     "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 1}}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "opt": {"enum": ["on", "off"]}}, "required": ["flag"],
     "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": 10, "maximum": 20},
                                      "grade": {"type": "string", "pattern": "^[A-F]$"}},
     "required": ["score", "grade"], "additionalProperties": False},
    {"type": "object", "properties": {"ver": {"type": "string", "pattern": "^v[0-9]\\.[0-9]$"},
                                      "deps": {"type": "array", "items": {"enum": ["np", "pd"]}, "maxItems": 2,
                                               "uniqueItems": True}},
     "required": ["ver"], "additionalProperties": False},
]

REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[a-z]{2,5}@[a-z]{3}\.(com|org)", r"-?[1-9][0-9]{0,2}"]
CHOICES = [["alpha", "beta", "gamma"], ["Positive", "Negative"]]
# Arithmetic on digits, e.g. 1+2*(3+4), with bounded repetition and nesting (a random model never
# stops on its own); parses_ebnf checks the unbounded language (sums of products of digits or
# parenthesised expressions), which contains it.
EBNF = ('root ::= expr\nexpr ::= term (("+" | "*") term){0,3}\n'
        'term ::= [1-9] | "(" [1-9] (("+" | "*") [1-9]){0,2} ")"')
_EXPR_TOKEN = re.compile(r"[1-9]|[()+*]")


def parses_ebnf(text: str) -> bool:
    """A recursive-descent check of EBNF's language (independent of xgrammar)."""
    toks = _EXPR_TOKEN.findall(text)
    if "".join(toks) != text:
        return False
    pos = 0

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(toks) and toks[pos] == "+":
            pos += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal pos
        if not factor():
            return False
        while pos < len(toks) and toks[pos] == "*":
            pos += 1
            if not factor():
                return False
        return True

    def factor() -> bool:
        nonlocal pos
        if pos < len(toks) and toks[pos].isdigit():
            pos += 1
            return True
        if pos < len(toks) and toks[pos] == "(":
            pos += 1
            if not expr() or pos >= len(toks) or toks[pos] != ")":
                return False
            pos += 1
            return True
        return False

    return expr() and pos == len(toks)


def json_problem(text: str, schema: dict) -> str | None:
    """Why text is not a JSON document valid under schema (None: it is)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON ({e}): {text!r}"
    try:
        jsonschema.validate(doc, schema)
    except jsonschema.ValidationError as e:
        return f"invalid ({e.message}): {text!r}"
    return None
