"""Source rules the layout issue asks for, checked on the source with ast: every module says its
one job in an opening docstring; only verispec/core/envs.py reads (or sets) the environment, so no
runtime module sets TRITON_INTERPRET: only the tests do."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "verispec"
MODULES = sorted(ROOT.rglob("*.py"))


def test_every_module_opens_with_a_docstring():
    missing = [str(p.relative_to(ROOT.parent)) for p in MODULES if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, f"modules without an opening docstring: {missing}"


def _environ_uses(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
    return lines


def test_only_envs_reads_the_environment():
    found = {str(p.relative_to(ROOT.parent)): lines for p in MODULES
             if (lines := _environ_uses(ast.parse(p.read_text()))) and p != ROOT / "core" / "envs.py"}
    assert not found, f"os.environ / os.getenv outside verispec/core/envs.py: {found}"


def test_the_environment_check_can_fail():
    assert _environ_uses(ast.parse("import os\nx = os.environ.get('A')\n")) == [2]
    assert _environ_uses(ast.parse("import os\nos.environ.setdefault('TRITON_INTERPRET', '1')\n")) == [2]

