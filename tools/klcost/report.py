"""Outputs of tools.kl_memory: the JSON rows, a markdown table and PNG plots (peak memory vs tokens
per method on a log scale with 80 GB and 141 GB capacity lines; the stacked RL-step budget)."""

from __future__ import annotations

import json
import os

GPU_CAPACITY = {"80 GB (A100/H100)": 80e9, "141 GB (H200)": 141e9}


def atomic_write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # never leave a half-written file where a good one was


def _fmt_bytes(b) -> str:
    return "-" if b is None else (f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB")


def table(rows: list[dict]) -> str:
    """One markdown line per row; peak and time also as ratios to gather and to the matmul floor; `memory`:
    how the peak was read (measure.py: memtracker, profiler, cuda_allocator); `first run s`: the first
    warm-up run (a compiled peer's compile included), not in the median."""
    head = ["| name | mode | pass | source | T | H | V | tp | dtype | peak | memory | peak / gather "
            "| time s (median) | min s | first run s | time / floor | comm bytes | comm calls |",
            "|" + "---|" * 4 + "---:|" * 6 + "---|" + "---:|" * 7]
    key = lambda r: (r["pass"], r["tokens"], r["hidden"], r["vocab"], r["tp"], r["dtype"], r["source"])
    gathers = {key(r): r["peak_bytes"] for r in rows if r["name"] == "gather"}
    out = []
    for r in rows:
        g = gathers.get(key(r))
        ratio = f"{r['peak_bytes'] / g:.3f}" if g else "-"
        num = lambda k, r=r: "-" if r.get(k) is None else f"{r[k]:.3f}"
        out.append(f"| {r['name']} | {r['mode']} | {r['pass']} | {r['source']} | {r['tokens']} | {r['hidden']} "
                   f"| {r['vocab']} | {r['tp']} | {r['dtype']} | {_fmt_bytes(r['peak_bytes'])} "
                   f"| {r.get('memory_source', '-')} | {ratio} | {num('time_s')} | {num('time_min_s')} "
                   f"| {num('first_run_s')} | {num('time_vs_floor')} | {r['comm_bytes']} "
                   f"| {r.get('comm_calls', '-')} |")
    return "\n".join(head + out)


def pivot(rows: list[dict], pass_: str = "forward+backward") -> str:
    """Peak GiB per (T, tp) line and method column for one pass, plus gather / fused_exact."""
    rs = [r for r in rows if r["pass"] == pass_]
    names = list(dict.fromkeys(r["name"] for r in rs))
    cells = {(r["tokens"], r["tp"], r["name"]): r["peak_bytes"] for r in rs}
    ratio = "gather / fused_exact" if {"gather", "fused_exact"} <= set(names) else None
    out = ["| T | tp | " + " | ".join(names) + (f" | {ratio} |" if ratio else " |"),
           "|---:|---:|" + "---:|" * (len(names) + bool(ratio))]
    for T, tp in sorted({(r["tokens"], r["tp"]) for r in rs}):
        vals = [cells.get((T, tp, n)) for n in names]
        line = f"| {T} | {tp} | " + " | ".join("-" if v is None else f"{v / 2**30:.2f}" for v in vals)
        if ratio:
            g, f = cells.get((T, tp, "gather")), cells.get((T, tp, "fused_exact"))
            line += f" | {g / f:.1f}" if g and f else " | -"
        out.append(line + " |")
    return "\n".join(out)


def plot_peak_vs_tokens(rows: list[dict], path: str, title: str) -> None:
    """Peak bytes vs tokens per rank, one line per (method, tp), log-log, with capacity lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    series: dict[tuple, list] = {}
    for r in rows:
        series.setdefault((r["name"], r["tp"]), []).append((r["tokens"], r["peak_bytes"]))
    for (name, tp), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] / 1e9 for p in pts], marker="o", label=f"{name} tp={tp}")
    for label, cap in GPU_CAPACITY.items():
        ax.axhline(cap / 1e9, linestyle="--", color="gray")
        ax.text(min(p[0] for v in series.values() for p in v), cap / 1e9 * 1.05, label, fontsize=8, color="gray")
    ax.set(xscale="log", yscale="log", xlabel="tokens per rank", ylabel="peak GB (KL head only)", title=title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_budget(budgets: list[tuple[str, dict]], path: str, title: str) -> None:
    """Stacked bars: one bar per labelled budget (core/runtime/budget.py parts, bytes), capacity lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [k for k in budgets[0][1]["parts"]]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(budgets)), 5))
    bottom = [0.0] * len(budgets)
    for part in parts:
        vals = [b["parts"][part] / 1e9 for _, b in budgets]
        ax.bar(range(len(budgets)), vals, bottom=bottom, label=part)
        bottom = [x + y for x, y in zip(bottom, vals)]
    for label, cap in GPU_CAPACITY.items():
        ax.axhline(cap / 1e9, linestyle="--", color="gray")
        ax.text(-0.4, cap / 1e9 * 1.02, label, fontsize=8, color="gray")
    ax.set_xticks(range(len(budgets)), [lab for lab, _ in budgets], rotation=30, ha="right", fontsize=7)
    ax.set(ylabel="GB per rank", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(folder: str, rows: list[dict], notes: list[str], command: str) -> list[str]:
    """rows.json, table.md and one peak-vs-tokens PNG per (H, V, dtype, pass) into `folder`."""
    os.makedirs(folder, exist_ok=True)
    written = [os.path.join(folder, "rows.json"), os.path.join(folder, "table.md")]
    atomic_write(written[0], json.dumps(rows, indent=1))
    sources = {r.get("memory_source") for r in rows} - {None}
    if len(sources) > 1:  # the pivot below mixes instruments: say which row used which
        notes = notes + [f"peaks read by {', '.join(sorted(sources))} (column memory; tools/klcost/measure.py); "
                         "tools/klcost/cpu_peak.py says where memtracker and profiler differ"]
    md = [f"`{command}`", ""] + [f"- note: {n}" for n in notes] + ["", table(rows), ""]
    for p in dict.fromkeys(r["pass"] for r in rows):
        md += [f"Peak GiB per rank, {p}:", "", pivot(rows, p), ""]
    atomic_write(written[1], "\n".join(md))
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["hidden"], r["vocab"], r["dtype"], r["pass"], r["source"]), []).append(r)
    for (H, V, dt, p, src), rs in groups.items():
        if len({r["tokens"] for r in rs}) < 2:
            continue  # a single token count makes no curve
        path = os.path.join(folder, f"peak_vs_tokens_H{H}_V{V}_{dt}_{p.replace('+', '_')}_{src}.png")
        plot_peak_vs_tokens(rs, path, f"H={H} V={V} {dt} {p} ({src})")
        written.append(path)
    return written
