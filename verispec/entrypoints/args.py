"""Command-line values shared by `generate`, `serve` and `bench`, parsed before anything slow."""

from __future__ import annotations

import json


def spec_json(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"verispec: --speculative-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise SystemExit("verispec: --speculative-config must be a JSON object")
    return value
