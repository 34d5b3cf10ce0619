"""The Markdown of ``finetune_speed.py``'s results: the headline table, every row, the notes.

Kept apart from the measuring script so each file holds one concept; it reads only the rows and
metadata the script writes to JSON, so the table can be redrawn from a saved run.
"""

from __future__ import annotations

from typing import Any

EXPANDED = "+positions"  # the suffix finetune_speed.py gives a case run with (B, T) position ids
COLUMNS = (
    ("dpfy_auto", "dpfy"),
    ("opacus_ghost", "Opacus ghost"),
    ("opacus_hooks", "Opacus hooks"),
)


def _ratios(row: dict[str, Any]) -> str:
    """``time× / memory×`` of one measured row."""
    memory = f"{row['memory_ratio']:.2f}×" if row.get("memory_ratio") else "?"
    return f"{row['time_ratio']:.2f}× / {memory}"


def _cell(rows: dict[tuple[str, str], dict[str, Any]], case: str, method: str,
          notes: list[str]) -> str:  # fmt: skip
    """One method's cell for one case: its ratios, or its error as a numbered note."""
    row = rows.get((case, method))
    if row is None:
        return "—"
    if "error" not in row:
        return _ratios(row)
    notes.append(f"{row['label']}, {method}: `{row['error'][:300]}`")
    retried = rows.get((case + EXPANDED, method))
    if retried is None:
        return f"fails [{len(notes)}]"
    if "error" in retried:
        notes.append(f"{row['label']}, {method}, (B, T) position ids: `{retried['error'][:300]}`")
        return f"fails [{len(notes) - 1}], also with (B, T) position ids [{len(notes)}]"
    return f"{_ratios(retried)} with (B, T) position ids; default call fails [{len(notes)}]"


def _engine(row: dict[str, Any] | None) -> str:
    """Which dpfy engine ran, and why it fell back to vmap if it did."""
    engine = (row or {}).get("engine") or {}
    if engine.get("kind") is None:
        return "—"
    reason = engine.get("fallback_reason")
    return engine["kind"] + (f" ({reason})" if reason else "")


def _headline(meta: dict[str, Any], rows: list[dict[str, Any]], notes: list[str]) -> list[str]:
    """Model, non-private step and peak, then each method's ratios against it."""
    by_key = {(r["case"], r["method"]): r for r in rows}
    cases = list(dict.fromkeys(r["case"] for r in rows if EXPANDED not in r["case"]))
    lines = [
        "| model (trainable) | non-private step, peak | "
        + " | ".join(f"{name}: time / memory" for _, name in COLUMNS)
        + " | dpfy engine |",
        "|---" * (len(COLUMNS) + 3) + "|",
    ]
    for case in cases:
        base = by_key.get((case, "nonprivate"), {})
        peak = base.get("peak")
        seconds = base.get("seconds")
        shown = f"{seconds * 1e3:.0f} ms" if seconds else "—"
        shown += f", {peak / 2**20:.0f} MiB" if peak else ""
        cells = [_cell(by_key, case, m, notes) for m, _ in COLUMNS]
        label = base.get("label") or next(r["label"] for r in rows if r["case"] == case)
        engine = _engine(by_key.get((case, "dpfy_auto")))
        lines.append(f"| {label} | {shown} | " + " | ".join(cells) + f" | {engine} |")
    return lines


def _all_rows(rows: list[dict[str, Any]]) -> list[str]:
    """Every measured row: median step and its non-private one, fastest, CPU time, peak."""
    lines = [
        "| case | method | median ms | non-private ms, same rounds | time × | fastest × | CPU × "
        "| peak MiB | memory × | rounds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            continue
        peak = f"{r['peak'] / 2**20:.1f}" if r.get("peak") else "?"
        memory = f"{r['memory_ratio']:.2f}" if r.get("memory_ratio") else "?"
        base = r.get("nonprivate_seconds")
        base_ms = f"{base * 1e3:.0f}" if base else "?"
        lines.append(
            f"| {r['case']} | {r['method']} | {r['seconds'] * 1e3:.0f} | {base_ms} | "
            f"{r['time_ratio']:.2f} | "
            f"{r['min_time_ratio']:.2f} | {r['cpu_time_ratio']:.2f} | {peak} | {memory} | "
            f"{r['rounds']} |"
        )
    return lines


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The results page: command and versions, the headline table, every row, the notes."""
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    notes: list[str] = []
    headline = _headline(meta, rows, notes)
    parts = [
        "# Fine-tuning step time and peak memory (issue 18)",
        "",
        f"`{meta['command']}` — {meta['date']}, {meta['device']}, {meta['threads']} threads; "
        f"{versions}.",
        "",
        "Ratios against non-private SGD measured in the same interleaved rounds (median step "
        "time / allocator peak above model, batch and optimizer state over two steps). The "
        "machine may have been shared, so the ratios are the result, not the absolute times.",
        "",
        *headline,
        "",
        *[f"[{i}] {note}" for i, note in enumerate(notes, 1)],
        "",
        "## Every measured row",
        "",
        *_all_rows(rows),
        "",
    ]
    return "\n".join(parts)
