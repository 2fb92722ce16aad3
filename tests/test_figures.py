"""One place for each figure (docs/benchmarks.md#add-a-figure): benchmarks/figures.json holds
every figure the README and docs/ quote, with its command, date and load; the headline table is
written from it; a quote ``<!-- figure KEY -->text<!-- /figure -->`` must be part of its
figure's value; a page that copies a figure's distinctive number without the marker fails; a
number in the prose that reads as a measurement is either such a quote or in NOT_MEASURED with
why; every figure names the command that measured it, with flags that command still has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import figures
from benchmarks.report import GOALS
from tests._markdown import ROOT, fenced_blocks, page_name, pages, prose


def test_the_headline_table_is_written_from_figures_json() -> None:
    text = figures.PAGE.read_text()
    assert figures.rewritten(text) == text, "run: python -m benchmarks.figures"


def test_every_quote_is_part_of_its_figure() -> None:
    known, bad, count = figures.load(), [], 0
    for page in pages():
        for key, text in figures.quotes(page.read_text()):
            count += 1
            if key not in known:
                bad.append(f"{page_name(page)}: no figure {key!r}")
            # a quote may wrap across lines, as Markdown prose does
            elif " ".join(text.split()) not in " ".join(known[key]["value"].split()):
                bad.append(f"{page_name(page)}: {text!r} is not in figure {key!r}")
    assert bad == []
    assert count >= 20  # the README's times, the verl table, benchmarks.md's prose


def _distinctive(value: str) -> set[str]:
    """Numbers of a value that are unlikely to appear by chance: a decimal with 3+ significant
    digits (0.986, 26.5x, 2.17), a time of a run (9:10), a range of times (175-275 µs)."""
    value = value.replace("**", "")
    decimals = re.findall(r"(?<![\d.])\d+\.\d+x?", value)
    found = {d for d in decimals if len(re.sub(r"^0\.|\D", "", d)) >= 3}  # not 0.25, 1.5
    found |= set(re.findall(r"(?<![\d:])\d{1,2}:\d\d(?:-\d{1,2}:\d\d)?(?![\d:])", value))
    found |= set(re.findall(r"(?<![\d.,])\d[\d,]*-\d[\d,]*(?= ?(?:µs|ms|s)\b)", value))
    return found


def test_no_page_keeps_its_own_copy_of_a_figure() -> None:
    tokens = {t: key for key, f in figures.load().items() if key != "goals"  # thresholds
              for t in _distinctive(f["value"])}  # fmt: skip
    copies = []
    for page in pages():
        text = figures.QUOTE.sub("", page.read_text())
        if page == figures.PAGE:
            text = text[: text.index(figures.BEGIN)] + text[text.index(figures.END) :]
        for token, key in tokens.items():
            if re.search(rf"(?<![\w.:,-]){re.escape(token)}(?![\w:,-]|\.\d)", text):
                copies.append(f"{page_name(page)}: {token} (figure {key!r})")
    assert copies == [], "quote these as <!-- figure KEY -->text<!-- /figure -->"


def test_the_goals_quoted_are_the_benchmarks_goals() -> None:
    """GOALS in benchmarks/report.py decides met/MISSED in RESULTS.md's Targets; the figure
    "goals" states them for the pages (0.97, 0.98 and 0.99 disagreed before)."""
    stated = figures.load()["goals"]["value"]
    expected = {
        "op_vs_mlflow_span": f"<= 1/{GOALS['op_vs_mlflow_span']:g} of `mlflow.start_span`",
        "op_vs_otel_span": f"<= 1/{GOALS['op_vs_otel_span']:g} of an OTel SDK span",
        "unsampled_over_bare_us": f"+ {GOALS['unsampled_over_bare_us']:g} µs",
        "trace_attr_us": f"< {GOALS['trace_attr_us']:g} µs",
        "durable_speedup": f">= {GOALS['durable_speedup']:g}x",
        "fast_engine_throughput": f">= {GOALS['fast_engine_throughput']:g} of untraced",
        "real_engine_throughput": f">= {GOALS['real_engine_throughput']:g} (real engine)",
        "cpu_vs_otel": f"<= {GOALS['cpu_vs_otel']:g}x",
    }
    assert set(expected) == set(GOALS)
    assert {k: v for k, v in expected.items() if v not in stated} == {}


def test_record_fills_date_and_load_and_rewrites_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, page = tmp_path / "figures.json", tmp_path / "benchmarks.md"
    data.write_text("{}\n")
    page.write_text(f"# x\n\n{figures.BEGIN}{figures.END}\n")
    monkeypatch.setattr(figures, "FIGURES", data)
    monkeypatch.setattr(figures, "PAGE", page)
    monkeypatch.setattr(figures, "load_average", lambda: "3.5")
    figures.record("k", "12 ms", figure="a thing", command="python -m benchmarks.x")
    entry = figures.load()["k"]
    assert entry["command"] == "`python -m benchmarks.x`" and entry["load"] == "3.5"
    assert "under load" in entry["value"] and re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d", entry["date"])
    assert "| a thing | 12 ms: **under load**" in page.read_text()
    assert figures.quotes("a <!-- figure k -->12 ms<!-- /figure --> b") == [("k", "12 ms")]
    assert _distinctive("9:04-10:14, 0.986 and 26.5x, 175-275 µs") >= {
        "9:04-10:14", "0.986", "26.5x", "175-275"}  # fmt: skip


# ---- numbers that read as measurements, and the commands behind the figures -------------------

_UNIT = r"(?:µs|ms|s|min|%|pp|MB|GB|MiB|GiB|KB|kB|x|traces/s|tokens/s)(?![\w/])"
_START = r"(?<![\w.,/-])~?"
MEASUREMENT = {
    # a decimal with a unit: 0.52 ms, 1.1 s, 0.0012 %
    "a decimal with a unit": re.compile(rf"{_START}\d+\.\d+ ?{_UNIT}"),
    # a range of decimals: 3.1-4.1 (CPU-seconds), with or without a unit
    "a range of decimals": re.compile(rf"{_START}\d+\.\d+ ?[-\u2013] ?\d+\.\d+(?![\d.])"),
    # a share that is not round: 98 %, 14 % (5 %, 50 %, 100 % are settings and scenarios)
    "a share that is not round": re.compile(rf"{_START}(\d*[1-46-9]) ?%"),
    # a series of readings: 56 / 125 / 169 / 220 / 212
    "a series": re.compile(rf"{_START}\d+(?: ?/ ?\d+){{3,}}(?![\w/])"),
}
# a table row with a date is a record of a run: its numbers with units are measurements
DATED_ROW = re.compile(r"^\|.*\b20\d\d-\d\d-\d\d\b.*$", re.M)
ROW_NUMBER = re.compile(rf"{_START}[\d,]*\d ?(?:µs|ms|s|min|MB|GB|MiB|GiB)(?![\w/])")

# Numbers in the prose that read as measurements and are not: page -> {text: why}
NOT_MEASURED: dict[str, dict[str, str]] = {
    "README.md": {"2 s": "the chaos test's bound: nothing finished 2 s before a SIGKILL is lost"},
    "docs/reliability.md": {
        "0.3 s": "a test's scenario: calls that fail after 0.3 s",
        "2 s": "the chaos test's bound: nothing finished 2 s before a SIGKILL is lost",
        "90 s": "a chaos schedule's length (a setting)",
        "60 s": "the suite's chaos schedule's length (a setting)",
        "150 s": "the full-size soak's length (a setting)",
        "1.5 s": "shutdown's bound past its timeout (the code's deadlines; test_shutdown checks)",
        "0.5 s": "the part of that bound idle workers get to leave (the code's)",
    },
    "docs/tracing.md": {"0.25 s": "the retry interval of a pending annotation (the code's)"},
    "docs/trl.md": {"2 %": "the goal (benchmarks/trl_cost.py), not a reading"},
    "docs/api.md": {"2 %": "the live analysis's goal (benchmarks/bench_live.py), not a reading"},
    "docs/explore.md": {"1.25x": "the length-bias rule's threshold (readers/timing/drops.py)"},
    "docs/export-schema.md": {"1.25x": "the length-bias rule's threshold (timing/drops.py)"},
    "docs/verl.md": {"0.5 s": "how often a rollout worker sends its partials (the code's)"},
    "docs/scale-out.md": {"0.5 ms": "issue #59's goal for PostgreSQL's CPU a trace, not a reading"},
}


def unmarked_measurements(text: str) -> list[str]:
    """What in ``text`` reads as a measurement outside a figure quote: the prose without its
    fenced blocks and inline code (settings, commands, example output)."""
    text = re.sub(r"`[^`]+`", "CODE", prose(figures.QUOTE.sub("FIGURE", text)))
    found = [m.group(0).strip() for rule in MEASUREMENT.values() for m in rule.finditer(text)]
    for row in DATED_ROW.finditer(text):
        found += [m.group(0).strip() for m in ROW_NUMBER.finditer(row.group(0))]
    return found


def test_no_unmarked_measurement_in_the_docs() -> None:
    """A reading is a figure (benchmarks/figures.json, with its command, date and load) quoted
    with its marker; anything else that looks like one is a setting, a goal or an example and
    says so in NOT_MEASURED."""
    bad = []
    for page in pages():
        text = page.read_text()
        if page == figures.PAGE:  # the generated table is figures.json itself
            text = text[: text.index(figures.BEGIN)] + text[text.index(figures.END) :]
        allowed = NOT_MEASURED.get(page_name(page), {})
        bad += [f"{page_name(page)}: {m}" for m in unmarked_measurements(text) if m not in allowed]
    assert bad == [], "quote a figure (docs/benchmarks.md#add-a-figure) or say it is none"
    stale = [f"{page}: {m}" for page, ms in NOT_MEASURED.items() for m in ms
             if m not in unmarked_measurements((ROOT / page).read_text())]  # fmt: skip
    assert stale == [], "NOT_MEASURED entries no page needs any more"


def benchmark_commands(text: str) -> list[tuple[str, list[str]]]:
    """(module file, its --flags) of each ``python -m benchmarks.X ...`` or ``python
    benchmarks/X.py ...`` in ``text``'s inline code and code blocks."""
    code = [m.group(1) for m in re.finditer(r"`([^`]+)`", prose(text))]
    code += [block for _, _, block in fenced_blocks(text)]
    found = []
    for snippet in code:
        for line in snippet.replace("\\\n", " ").splitlines():
            for m in re.finditer(r"python3? (?:-m benchmarks\.(\w+)|benchmarks/(\w+)\.py)"
                                 r"((?: +[^\s;|&]+)*)", line):  # fmt: skip
                module = f"benchmarks/{m.group(1) or m.group(2)}.py"
                found.append((module, re.findall(r"(?<!\S)(--[a-z][\w-]*)", m.group(3))))
    return found


def missing_flags(commands: list[tuple[str, list[str]]]) -> list[str]:
    bad = []
    for module, flags in commands:
        path = ROOT / module
        source = path.read_text() if path.is_file() else ""
        if not source:
            bad.append(f"{module}: no such benchmark")
        # argparse options are declared as strings in the module (or the helpers it shares)
        source += (ROOT / "benchmarks" / "common.py").read_text()
        bad += [f"{module} {flag}" for flag in flags if f'"{flag}"' not in source]
    return bad


def test_every_figure_names_its_command_and_the_command_still_runs() -> None:
    known = figures.load()
    unrecorded = [key for key, f in known.items()
                  if "not recorded" in f["command"] or "`" not in f["command"]]  # fmt: skip
    assert unrecorded == [], "figures without the command that measured them"
    commands = [c for f in known.values() for c in benchmark_commands(f["command"])]
    for page in pages():
        commands += benchmark_commands(page.read_text())
    assert len(commands) >= 20
    assert missing_flags(commands) == [], "a quoted benchmark command names a flag it lacks"


def test_the_measurement_checks_can_fail() -> None:
    text = (
        "0.52 ms of the trainer's thread, 0.0012 % of the step; untraced steps varied by 98 %;"
        " writers 3.1-4.1; the scan took 1.1 s; 56 / 125 / 169 / 220 / 212 traces/s.\n\n"
        "| run | 106 s | 2026-12-02 |\n\n`stuck_after_s=1.5 s` and 5 % and 100 % and "
        "<!-- figure k -->2.4 ms<!-- /figure -->\n"
    )
    assert unmarked_measurements(text) == [
        "0.52 ms", "0.0012 %", "1.1 s", "3.1-4.1", "98 %", "56 / 125 / 169 / 220 / 212",
        "106 s"]  # fmt: skip
    gone = benchmark_commands("`python -m benchmarks.ingest --n 100 --load-n 250`")
    assert gone == [("benchmarks/ingest.py", ["--n", "--load-n"])]
    assert missing_flags(gone) == ["benchmarks/ingest.py --load-n"]
    readers = benchmark_commands("`python benchmarks/bench_readers.py --repeats 3`")
    assert missing_flags(readers) == []
