"""The layers import one way: every import of a verispec module (at module level, inside a
function, or under TYPE_CHECKING) may only reach its own package or a lower layer. The walk reads
the source with ast, so a lazy import inside a function counts like any other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "verispec"

# Highest first. A module may import its own package (same top-level name) and anything listed
# below its layer; never a sibling of its own layer, never upward. Longest prefix wins.
LAYERS: list[tuple[str, ...]] = [
    ("verispec", "verispec.entrypoints.cli"),  # the package facade (lazy LLM) and the command
    ("verispec.bench",),
    ("verispec.train",),
    ("verispec.entrypoints",),
    ("verispec.engine",),
    ("verispec.distributed",),
    ("verispec.spec_decode",),
    ("verispec.worker",),
    ("verispec.loader",),
    ("verispec.models",),
    ("verispec.attention",),
    ("verispec.kernels",),
    # Pure torch ggml dequantization (imports nothing of verispec): the loader's, and the reference of
    # kernels/gguf_matmul.py.
    ("verispec.loader.dequant",),
    ("verispec.config", "verispec.outputs", "verispec.sampling_params"),
    ("verispec.core",),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> tuple[int, str]:
    """(layer rank, unit) of a module: rank 0 is the top; the unit is the longest listed prefix."""
    best: tuple[int, str] | None = None
    for rank, units in enumerate(LAYERS):
        for unit in units:
            if (module == unit or module.startswith(unit + ".")) and (best is None or len(unit) > len(best[1])):
                best = (rank, unit)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def imports_of(path: Path) -> list[tuple[str, int]]:
    """(imported verispec module, line) for every import statement in the file, wherever it sits."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path).split(".")
    is_pkg = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "verispec"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if is_pkg else here[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "verispec":
                continue
            # `from pkg import submodule` imports the submodule.
            for a in node.names:
                sub = f"{mod}.{a.name}"
                found.append((sub if (ROOT.parent / Path(*sub.split("."))).with_suffix(".py").exists()
                              or (ROOT.parent / Path(*sub.split("."))).is_dir() else mod, node.lineno))
    return found


def all_modules() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def violations() -> list[str]:
    bad = []
    for path in all_modules():
        me = module_name(path)
        my_rank, my_unit = unit_of(me)
        for target, line in imports_of(path):
            rank, unit = unit_of(target)
            if unit == my_unit or rank > my_rank:
                continue
            where = f"{path.relative_to(ROOT.parent)}:{line}"
            kind = "upward" if rank < my_rank else "sideways"
            bad.append(f"{where}: {me} imports {target} ({kind}: {my_unit} -> {unit})")
    return bad


def test_imports_follow_the_layers():
    bad = violations()
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_core_imports_nothing_from_verispec_outside_itself():
    for path in sorted((ROOT / "core").rglob("*.py")):
        for target, line in imports_of(path):
            assert target.startswith("verispec.core"), f"{path}:{line} imports {target}"


def test_no_import_cycles_between_modules():
    graph = {module_name(p): {t for t, _ in imports_of(p)} for p in all_modules()}
    names = set(graph)
    graph = {m: {t for t in ts if t in names and t != m} for m, ts in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


@pytest.mark.parametrize("source, expect", [
    ("def f():\n    from verispec.engine.engine import LLMEngine\n", "upward"),
    ("from verispec.worker import runner\n", "upward"),
    ("import verispec.entrypoints.llm\n", "upward"),
])
def test_the_walk_sees_hidden_and_plain_upward_imports(tmp_path, monkeypatch, source, expect):
    """A planted upward import inside a kernel module is reported (the gate can fail)."""
    fake_root = tmp_path / "verispec"
    (fake_root / "kernels").mkdir(parents=True)
    for pkg in ("engine", "worker", "entrypoints"):
        (fake_root / pkg).mkdir()
        (fake_root / pkg / "__init__.py").write_text("")
    (fake_root / "engine" / "engine.py").write_text("")
    (fake_root / "worker" / "runner.py").write_text("")
    (fake_root / "entrypoints" / "llm.py").write_text("")
    (fake_root / "kernels" / "bad.py").write_text(source)
    monkeypatch.setitem(globals(), "ROOT", fake_root)
    bad = violations()
    assert len(bad) == 1 and expect in bad[0] and "kernels/bad.py" in bad[0], bad
