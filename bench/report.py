"""Results of the benchmark suite: ``<results>/<scenario>.json``, ``.md`` (a readable table) and ``.png``
(bar plots), and ``<results>/summary.md`` gathered from every scenario JSON in the folder.

A scenario's ``plot`` spec: ``group_by`` (one panel per value of this column), then either ``label``
(a ``str.format`` template over the row, e.g. ``"{runtime}, {stages} stages"``) with ``value`` (the
bar's column), or ``bars`` (several value columns, one bar each, labelled by column name); ``skip``
({column: value}) leaves rows out.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

SUMMARY_FILE = "summary.md"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)"
    columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def write_rows(out: Path, stem: str, command: str, rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A standalone benchmark's results through harness.write_results (JSON with the machine, the chosen
    columns as a table); returns the table. Kept for the scripts that call it by this name."""
    from harness import write_results  # harness imports this module

    return write_results(stem, rows, columns=columns, out=out, command=command.strip())


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value).replace("|", "\\|")


def describe(facts: dict[str, Any]) -> str:
    """The machine in one line (harness.describe)."""
    from harness import describe as line

    return line(facts)


def scenario_markdown(key: str, doc: dict[str, Any]) -> str:
    out = [f"# Scenario {key}: {doc['title']}", "",
           f"Run {doc['created']} on {describe(doc['machine'])}. Command: `{doc['command']}`", "",
           f"**Target** (reported, never asserted): {doc['target']}", "", markdown_table(doc["rows"]), ""]
    out += [f"- {note}" for note in doc.get("notes", [])]
    settings = {k: v for k, v in doc.get("settings", {}).items() if k != "per_model"}
    out += ["", "Settings:", ""] + [f"- {k}: {v}" for k, v in settings.items()]
    for model, s in doc.get("settings", {}).get("per_model", {}).items():
        out.append(f"- {model}: " + ", ".join(f"{k}={v}" for k, v in s.items()))
    if doc.get("plot_file"):
        out += ["", f"![{key}]({doc['plot_file']})"]
    return "\n".join(out) + "\n"


def plot(key: str, title: str, rows: list[dict[str, Any]], spec: dict[str, Any], path: Path) -> bool:
    """Horizontal bar panels, one per ``group_by`` value; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if spec.get("kind") == "lines":
        return _lines(key, title, rows, spec, path, plt)
    skip = spec.get("skip", {})
    rows = [r for r in rows if not any(r.get(k) == v for k, v in skip.items())]
    groups = list(dict.fromkeys(r[spec["group_by"]] for r in rows))
    bars_per_group = {g: _bars(spec, [r for r in rows if r[spec["group_by"]] == g]) for g in groups}
    height = sum(len(b) for b in bars_per_group.values()) * 0.35 + 1.2 * len(groups)
    fig, axes = plt.subplots(len(groups), 1, figsize=(8, max(2.5, height)), squeeze=False)
    for ax, group in zip(axes[:, 0], groups, strict=True):
        bars = bars_per_group[group]
        labels, values = [b[0] for b in bars], [float(b[1]) for b in bars]
        ax.barh(range(len(values)), values, color="#4c72b0")
        ax.set_yticks(range(len(values)), labels)
        ax.invert_yaxis()
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:g}", va="center", fontsize=8)
        ax.set_title(str(group), fontsize=10)
        ax.set_xlabel(spec.get("ylabel", ""))
        ax.margins(x=0.15)
    fig.suptitle(f"{key}: {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _lines(key: str, title: str, rows: list[dict[str, Any]], spec: dict[str, Any], path: Path, plt: Any) -> bool:
    """One line per ``series`` value: ``y`` against ``x`` (e.g. speedup against acceptance rate, per K)."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for series in dict.fromkeys(r[spec["series"]] for r in rows):
        points = sorted((r[spec["x"]], r[spec["y"]]) for r in rows if r[spec["series"]] == series)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{spec['series']}={series}")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel(spec.get("xlabel", spec["x"]))
    ax.set_ylabel(spec.get("ylabel", spec["y"]))
    ax.legend(fontsize=8, ncol=2)
    ax.set_title(f"{key}: {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _bars(spec: dict[str, Any], rows: list[dict[str, Any]]) -> list[tuple[str, float]]:
    if "bars" in spec:
        return [(column, row[column]) for row in rows for column in spec["bars"]]
    return [(spec["label"].format(**row), row[spec["value"]]) for row in rows]


def write_scenario(results: Path, key: str, title: str, result: dict[str, Any], machine: dict[str, Any],
                   command: str) -> Path:
    """Write <key>.json, <key>.md and <key>.png; return the markdown path."""
    results.mkdir(parents=True, exist_ok=True)
    doc = {"scenario": key, "title": title, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": command, "machine": machine, **result}
    spec = doc.pop("plot", None)
    if spec and plot(key, title, doc["rows"], spec, results / f"{key}.png"):
        doc["plot_file"] = f"{key}.png"
    (results / f"{key}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md = results / f"{key}.md"
    md.write_text(scenario_markdown(key, doc))
    return md


def write_summary(results: Path) -> Path:
    """summary.md: the summary rows of every scenario JSON in ``results`` (the newest run of each)."""
    rows, runs = [], []
    for path in sorted(results.glob("*.json")):
        doc = json.loads(path.read_text())
        if "scenario" not in doc:
            continue  # another script's results (compile_memory.json)
        runs.append(f"- {doc['scenario']}: {doc['title']} ({doc['created']}, `{doc['command']}`)")
        rows += [{"scenario": doc["scenario"], **row} for row in doc.get("summary", [])]
    text = "\n".join(["# ovshard benchmark suite: summary", "", markdown_table(rows), "", "Runs:", "", *runs]) + "\n"
    out = results / SUMMARY_FILE
    out.write_text(text)
    return out
