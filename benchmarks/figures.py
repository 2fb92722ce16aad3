"""The one place for every figure the README and docs/ quote: ``benchmarks/figures.json``, one
entry per figure with its value, the command that measured it, the date (UTC) and the load
average. docs/benchmarks.md's "Headline figures" table is written from it, and a page quotes a
figure as ``<!-- figure KEY -->text<!-- /figure -->``, where ``text`` is part of that figure's
value; tests/test_figures.py fails when a quote is not, when the table is stale, and when a
page copies a figure's number without the marker.

    python -m benchmarks.figures                      # rewrite docs/benchmarks.md's table
    python -m benchmarks.figures set KEY "VALUE" --figure "what was measured" \\
        --command "python -m benchmarks.x --n 100"    # record one: date and load added

A benchmark can record its own figure the same way: :func:`record`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "benchmarks" / "figures.json"
PAGE = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- begin figures -->\n", "<!-- end figures -->"
QUOTE = re.compile(r"<!-- figure ([a-z0-9-]+) -->(.*?)<!-- /figure -->", re.S)  # keys: lower case
FIELDS = ("figure", "value", "command", "date", "load")


def load() -> dict[str, dict[str, str]]:
    data: dict[str, dict[str, str]] = json.loads(FIGURES.read_text(encoding="utf-8"))
    return data


def save(figures: dict[str, dict[str, str]]) -> None:
    text = json.dumps(figures, indent=1, ensure_ascii=False)
    FIGURES.write_text(text + "\n", encoding="utf-8")


def load_average() -> str:
    """The 1-minute load average now, as the table writes it (``quiet`` below 0.5)."""
    try:
        one = float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return "not recorded"
    return "quiet" if one < 0.5 else f"{one:.1f}"


def record(key: str, value: str, *, figure: str, command: str) -> None:
    """Store one figure now (date and load filled in) and rewrite the table. A value taken at
    a load above 2 gets "under load" appended: it must not be used to size anything."""
    figures = load()
    load_now = load_average()
    if (
        load_now not in ("quiet", "not recorded")
        and float(load_now) > 2
        and ("under load" not in value)
    ):
        value += ": **under load**, not for sizing"
    figures[key] = {
        "figure": figure,
        "value": value,
        "command": f"`{command}`" if "`" not in command else command,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "load": load_now,
    }
    save(figures)
    write_table()


def table(figures: dict[str, dict[str, str]] | None = None) -> str:
    figures = load() if figures is None else figures
    rows = ["| figure | value | command | date (UTC) | load |", "|---|---|---|---|---|"]
    for key, f in figures.items():
        missing = [name for name in FIELDS if not f.get(name)]
        if missing:
            raise ValueError(f"figure {key!r} lacks {missing}")
        rows.append(
            f"| {f['figure']} | {f['value']} | {f['command']} | {f['date']} | {f['load']} |"
        )
    return "\n".join(rows) + "\n"


def rewritten(page_text: str) -> str:
    start, end = page_text.index(BEGIN) + len(BEGIN), page_text.index(END)
    return page_text[:start] + table() + page_text[end:]


def write_table() -> bool:
    """Rewrite the table in docs/benchmarks.md; whether it changed."""
    text = PAGE.read_text(encoding="utf-8")
    new = rewritten(text)
    if new != text:
        PAGE.write_text(new, encoding="utf-8")
    return new != text


def quotes(text: str) -> list[tuple[str, str]]:
    """(key, quoted text) for every ``<!-- figure KEY -->text<!-- /figure -->`` in ``text``."""
    return [(m.group(1), m.group(2)) for m in QUOTE.finditer(text)]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.figures", description=__doc__)
    sub = ap.add_subparsers(dest="command_name")
    put = sub.add_parser("set", help="record one figure (date and load filled in)")
    put.add_argument("key")
    put.add_argument("value")
    put.add_argument("--figure", required=True, help="what was measured")
    put.add_argument("--command", required=True, help="the command that measured it")
    args: Any = ap.parse_args(argv)
    if args.command_name == "set":
        record(args.key, args.value, figure=args.figure, command=args.command)
    else:
        print("rewritten" if write_table() else "up to date", PAGE.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
