"""Bench output: aligned plain-text tables, the --json file and an optional PNG plot (matplotlib if present).

Every result dict has: kind ("latency" | "throughput" | "spec"), model, device, dtype, random_weights,
load_s, hardware (GPU limits used for the fractions), settings (the options), rows (verispec, one per
configuration), peers (Hugging Face rows, possibly empty), reference (published figures).
Row keys per kind are listed in latency.py, throughput.py and spec.py.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

Column = tuple[str, str, str]  # (row key, header, format spec)


def _cell(row: dict, key: str, fmt: str) -> str:
    """A value as its column shows it; format "range" shows numbers as "min-max" ("21,443-25,049")."""
    v = row.get(key)
    if v is None:
        return "-"
    if fmt == "range":
        return f"{min(v):,.0f}-{max(v):,.0f}" if v else "-"
    if isinstance(v, list):
        return "[" + ",".join(format(x, fmt) for x in v) + "]"
    try:
        return format(v, fmt)
    except (TypeError, ValueError):
        return str(v)


def table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    """Rows as an aligned text table: the first column left-aligned, the others right-aligned."""
    cells = [[h for _, h, _ in columns]] + [[_cell(r, k, f) for k, _, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = []
    for c in cells:
        parts = [c[0].ljust(widths[0])] + [c[i].rjust(widths[i]) for i in range(1, len(columns))]
        lines.append("  ".join(parts))
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def header(res: dict) -> str:
    """One line naming what ran where."""
    weights = "random weights" if res.get("random_weights") else "real weights"
    mem = ""
    if "weight_bytes" in res:
        mem = (f"; weights {res['weight_bytes'] / 1e6:.0f} MB as held (quantization {res.get('quantization', 'none')}),"
               f" {res['weight_bytes_per_step'] / 1e6:.0f} MB read per decode step")
    return (f"verispec bench {res['kind']}: {res['model']} ({weights}, {res['dtype']}) on {res['device']}, "
            f"loaded in {res.get('load_s', 0):.1f}s{mem}; hw% = max(bytes/s / "
            f"{res['hardware']['hbm_bytes_per_s']:.2g}, FLOP/s / {res['hardware']['bf16_flops_per_s']:.2g})")


def hw_column(rows: list[dict]) -> None:
    """Add the 'hw' display cell, e.g. '41.2% mem', to rows that have hw_frac."""
    for r in rows:
        if "hw_frac" in r:
            r["hw"] = f"{100 * r['hw_frac']:.1f}% {r.get('hw_bound', '')}"


def write_json(res: dict, path: str | None) -> None:
    """Write the result (without bulky token lists) to `path` when given."""
    if not path:
        return
    Path(path).write_text(json.dumps(strip_outputs(res), indent=2, default=str) + "\n", encoding="utf-8")


def strip_outputs(obj):
    """A copy without "outputs" token lists (kept in memory for checks, too big for the JSON); other
    "outputs" values (throughput's "final" / "stream") stay."""
    if isinstance(obj, dict):
        return {k: strip_outputs(v) for k, v in obj.items() if k != "outputs" or not isinstance(v, list)}
    if isinstance(obj, list):
        return [strip_outputs(v) for v in obj]
    return obj


def plot(res: dict, path: str | None) -> str | None:
    """Draw the result as a PNG at `path`; returns a note when skipped (no path, or no matplotlib)."""
    if not path:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed: no plot written to {path}"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    kind = res["kind"]
    if kind == "spec":
        _bars(ax, res)
    else:
        xkey, ykey = ("batch_size", "decode_tok_s") if kind == "latency" else ("num_seqs", "output_tok_s")
        rows = [r for r in res["rows"] if r.get(xkey) is not None]
        if rows:
            ax.plot([r[xkey] for r in rows], [r[ykey] for r in rows], "o-", label="verispec")
        for name in sorted({p["peer"] for p in res.get("peers", []) if "error" not in p}):
            pts = [p for p in res["peers"] if p["peer"] == name and "error" not in p and p.get(xkey) is not None]
            ax.plot([p[xkey] for p in pts], [p[ykey] for p in pts], "s--", label=name)
        ref = res.get("reference", {}).get("llamacpp_1.5b_bf16_batched_tok_s") if kind == "throughput" else None
        if ref and any("llamacpp_tok_s" in r for r in rows):  # only for the comparable 128 + 256 sweep
            ax.plot([int(k) for k in ref], list(ref.values()), "^:", label="llama.cpp (published)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xkey.replace("_", " "))
        ax.set_ylabel(ykey.replace("_", " "))
    ax.set_title(f"verispec bench {kind}: {res['model']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _bars(ax, res: dict) -> None:
    rows = res["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    sizes = list(dict.fromkeys(r["batch_size"] for r in rows))
    width = 0.8 / max(len(sizes), 1)
    for j, b in enumerate(sizes):
        vals = [next((r["tok_s"] for r in rows if r["method"] == m and r["batch_size"] == b), 0) for m in methods]
        ax.bar([i + j * width for i in range(len(methods))], vals, width, label=f"batch {b}")
    peers = [p for p in res.get("peers", []) if "error" not in p]
    base = len(methods)
    for i, p in enumerate(peers):
        ax.bar(base + i, p["tok_s"], 0.8 / max(len(sizes), 1), color="grey")
    ax.set_xticks(list(range(base + len(peers))), methods + [p["peer"] for p in peers], rotation=30, fontsize=8)
    ax.set_ylabel("output tok/s")
