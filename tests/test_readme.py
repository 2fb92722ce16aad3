"""The README and docs/ are tests: every Python block runs as written and does what the text says,
every `rollout-tracer` command they show parses, every relative link and anchor resolves, the
configuration table is TraceConfig's, every headline figure names its command, date and load,
and the README stays short (tests/test_layout.py checks docs/layout.md's table of modules)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest

import tracer
from tests._markdown import (
    README,
    ROOT,
    anchors,
    fenced_blocks,
    inline_commands,
    links,
    page_name,
    pages,
    shell_commands,
)
from tracer.config import TraceConfig

DOCS = ROOT / "docs"


def test_the_readme_stays_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move detail into docs/ (aim: <= 250)"


# ---- every Python block runs and does what its text says --------------------------------------


def _records(path: str) -> list[Any]:
    from tracer.record import read_jsonl

    return list(read_jsonl(path))


def check_sixteen_lines(ns: dict[str, Any], printed: str) -> None:
    records = _records("traces/my-run.jsonl")
    assert sorted(r.rollout_n for r in records) == [0, 1, 2, 3]  # one GRPO group of 4
    for r in records:
        assert r.step == 1 and r.sample_index == 0
        kinds = sorted(s.kind for s in r.spans)
        assert kinds == ["generate", "reward", "tool", "trajectory"], kinds
        tool = next(s for s in r.spans if s.kind == "tool")
        assert tool.outputs == "5" or tool.outputs == {"result": "5"}, tool.outputs
        assert r.reward == 1.0


def check_agent_loop(ns: dict[str, Any], printed: str) -> None:
    records = _records("traces/my-run.jsonl")
    assert len(records) == 4  # 1 sample x n=4
    assert sorted(r.rollout_n for r in records) == [0, 1, 2, 3]
    for r in records:
        assert (r.project_name, r.experiment_name, r.step) == ("gsm8k-grpo", "run-7", 1)
        kinds = [s.kind for s in r.spans]
        assert kinds.count("trajectory") == 1, kinds  # only the root: no nested trajectory
        assert sorted(kinds) == ["generate", "reward", "tool", "trajectory"], kinds
        assert r.reward == 1.0
    assert printed.startswith("[1.0, 1.0, 1.0, 1.0]")


def store_gsm8k_step_3() -> None:
    """What the export-schema block reads: a run of experiment gsm8k in ./mlflow.db."""
    tracer.init({"backend": "mlflow", "tracking_uri": "sqlite:///mlflow.db",
                 "project_name": "gsm8k", "export_in_subprocess": False})  # fmt: skip

    @tracer.trace_op(kind="reward")
    def reward(answer: str) -> float:
        return float(answer == "5")

    for step in (2, 3):
        for k in range(2):
            with tracer.trace_attr(step=step, sample_index=0, rollout_n=k):
                reward("5" if k else "4")
    assert tracer.flush(timeout_s=60)
    tracer.reset()


def check_read_tables(ns: dict[str, Any], printed: str) -> None:
    t = ns["t"]
    assert sorted(t.trajectories["step"]) == [3, 3]
    assert sorted(t.trajectories["reward"]) == [0.0, 1.0]


def check_api_step(ns: dict[str, Any], printed: str) -> None:
    assert printed.splitlines() == [
        "4 stored",  # sample 0 by head sampling, sample 1's group by the tool_errors rule
        "[(0, 0, 1.0), (0, 1, 1.0), (1, 0, 1.0), (1, 1, 0.0)]",
    ]


def check_step_metrics(ns: dict[str, Any], printed: str) -> None:
    # one wrong answer paid in four is no pattern (a group needs 5 a step and half unearned)
    assert printed.splitlines() == ["1 4.0 0.0", "2 4.0 0.0"]


def check_api_inside(ns: dict[str, Any], printed: str) -> None:
    assert printed.splitlines() == ["None", "['query'] True"]


def check_removed_key(ns: dict[str, Any], printed: str) -> None:
    assert "'background_yield_s' was removed" in printed and "delete the key" in printed


def check_misspelt_variable(ns: dict[str, Any], printed: str) -> None:
    assert printed.strip() == (
        "unknown variable ROLLOUT_TRACER_SPOL_DIR (did you mean `ROLLOUT_TRACER_SPOOL_DIR`?)"
    )
    assert tracer.get_tracer().config.backend == []  # init failed: nothing was started


# (page, heading above the block) -> (set-up or None, what it must have done).
# A new block needs its entry here.
SNIPPETS: dict[tuple[str, str], tuple[Callable[[], None] | None, Callable[..., None]]] = {
    ("README.md", "Your own rollout, in 16 lines"): (None, check_sixteen_lines),
    ("docs/tracing.md", "An agent loop, traced"): (None, check_agent_loop),
    ("docs/export-schema.md", "Export schema (version 1)"): (store_gsm8k_step_3, check_read_tables),
    ("docs/api.md", "A traced step, read back"): (None, check_api_step),
    ("docs/api.md", "Inside an op"): (None, check_api_inside),
    ("docs/api.md", "`step_metrics`"): (None, check_step_metrics),
    ("docs/upgrading.md", "Removed configuration keys"): (None, check_removed_key),
    ("docs/troubleshooting.md", "A misspelt variable"): (None, check_misspelt_variable),
}


def python_blocks() -> list[tuple[str, str, str]]:
    return [(page_name(p), heading, code) for p in pages()
            for lang, heading, code in fenced_blocks(p.read_text())
            if lang == "python"]  # fmt: skip


@pytest.mark.parametrize(("page", "heading", "code"), python_blocks(),
                         ids=lambda v: str(v)[:30])  # fmt: skip
def test_python_block_runs_as_written(
    page: str, heading: str, code: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (page, heading) in SNIPPETS, f"{page}: block under {heading!r} has no check here"
    setup, check = SNIPPETS[(page, heading)]
    if setup is not None:
        setup()
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(code, f"{page} ({heading})", "exec"), ns)
    check(ns, capsys.readouterr().out)


def test_every_snippet_entry_has_its_block() -> None:
    found = {(page, heading) for page, heading, _ in python_blocks()}
    assert set(SNIPPETS) - found == set(), "checks for blocks that are gone"


# ---- every rollout-tracer command shown parses -------------------------------------------------


def shown_commands(inline: bool) -> list[tuple[str, list[str]]]:
    """`rollout-tracer` commands in shell blocks (inline=False) or in inline code (True)."""
    found = []
    for page in pages():
        text = page.read_text()
        if inline:
            found += [(page_name(page), c) for c in inline_commands(text, "rollout-tracer")]
            continue
        for lang, _, code in fenced_blocks(text):
            if lang in ("bash", "sh", "shell", "console"):
                found += [(page_name(page), c) for c in shell_commands(code)
                          if c[0] == "rollout-tracer"]  # fmt: skip
    return found


def test_the_docs_show_commands() -> None:
    commands = {c[1] for _, c in shown_commands(inline=False) if len(c) > 1}
    assert {"run", "ui", "explore", "report", "export", "flags", "replay"} <= commands


def test_shown_commands_parse() -> None:
    """A command in a shell block is one to copy: it parses whole, and `run`'s dotted overrides
    name real keys."""
    from rollout.cli import build_parser
    from rollout.config import load_config

    parser, bad = build_parser(), []
    for page, argv in shown_commands(inline=False):
        try:
            args = parser.parse_args(argv[1:])
            if args.command == "run":
                load_config(args.overrides, args.config)
        except (SystemExit, ValueError) as exc:
            bad.append(f"{page}: `{' '.join(argv)}` ({type(exc).__name__}: {exc})")
    assert bad == []


def _options(command: str) -> set[str]:
    from rollout.cli import build_parser

    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert command in sub.choices, f"no subcommand {command!r}"
    return set(sub.choices[command]._option_string_actions)


def test_commands_named_in_the_text_exist() -> None:
    """In the prose a command is often named with one flag, not whole: its subcommand and every
    option it names exist."""
    bad = []
    for page, argv in shown_commands(inline=True):
        if len(argv) < 2:
            continue
        options = _options(argv[1])
        named = {w.split("=")[0] for w in argv[2:] if w.startswith("--")}
        if not named <= options:
            bad.append(f"{page}: `{' '.join(argv)}`: no {sorted(named - options)}")
    assert bad == []


# ---- links and anchors -------------------------------------------------------------------------


def relative_links() -> list[tuple[str, str]]:
    return [(page_name(p), t) for p in pages() for t in links(p.read_text())
            if not re.match(r"[a-z]+:", t)]  # fmt: skip


def test_pages_link_to_each_other() -> None:
    readme_links = {t for page, t in relative_links() if page == "README.md"}
    for doc in DOCS.glob("*.md"):
        assert f"docs/{doc.name}" in readme_links, f"README.md does not link docs/{doc.name}"


def test_relative_links_resolve() -> None:
    dead = []
    for page, target in relative_links():
        path, _, anchor = target.partition("#")
        source = ROOT / page
        resolved = (source.parent / path).resolve() if path else source
        if not resolved.exists():
            dead.append(f"{page}: {target} (no such file)")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved.read_text())):
            dead.append(f"{page}: {target} (no such heading)")
    assert dead == []
    assert len(relative_links()) > 50  # the check must not go quiet


def test_the_link_check_can_fail() -> None:
    from tests._markdown import slug

    assert slug("What differs from verl's own tracer") == "what-differs-from-verls-own-tracer"
    assert slug("Every option (`tracer.TraceConfig`)") == "every-option-tracertraceconfig"
    assert links("[a](x.md#y) `[b](not-a-link.md)`\n```\n[c](in-code.md)\n```\n") == ["x.md#y"]
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


# ---- the configuration table is TraceConfig's --------------------------------------------------


def config_rows() -> list[tuple[list[str], str]]:
    text = (DOCS / "configuration.md").read_text()
    section = text[text.index("## Every option (`tracer.TraceConfig`)"):]
    section = section[section.index("| field |"):]
    section = section[: section.index("\n\n")]
    rows = []
    for row in section.splitlines()[2:]:
        cells = row.split("|")
        rows.append((re.findall(r"`([a-z_0-9]+)`", cells[1]), cells[2]))
    return rows


def test_the_config_table_documents_every_field() -> None:
    documented = [name for names, _ in config_rows() for name in names]
    fields = {f.name for f in dataclasses.fields(TraceConfig)}
    assert fields - set(documented) == set(), "fields missing from docs/configuration.md"
    assert set(documented) - fields == set(), "docs/configuration.md names fields TraceConfig lacks"
    assert len(documented) == len(set(documented)), "a field listed twice"


def test_the_config_table_defaults_are_the_codes() -> None:
    defaults = {}
    for f in dataclasses.fields(TraceConfig):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    checked = 0
    for names, cell in config_rows():
        parts = [p.strip() for p in cell.split(" / ")]
        if len(parts) != len(names):
            continue
        for name, part in zip(names, parts, strict=True):
            literal = re.fullmatch(r"`([^`]+)`", part)
            if literal is None or name not in defaults:
                continue
            try:
                value = ast.literal_eval(literal.group(1))
            except (ValueError, SyntaxError):
                continue  # a path or a variable name, not a Python literal
            assert value == defaults[name], f"{name}: the page says {value!r}"
            checked += 1
    assert checked >= 20  # most defaults are literals; the check must not go quiet


# ---- figures name their command, date and load -------------------------------------------------


def figure_rows() -> list[list[str]]:
    text = (DOCS / "benchmarks.md").read_text()
    section = text[text.index("## Headline figures"):]
    section = section[section.index("| figure |"):]
    section = section[: section.index("<!-- end figures -->")]  # benchmarks/figures.py writes it
    return [[c.strip() for c in row.split("|")[1:-1]] for row in section.splitlines()[2:]]


def test_every_figure_names_command_date_and_load() -> None:
    rows = figure_rows()
    assert len(rows) >= 10
    for figure, value, command, date, load in rows:
        assert "`" in command or command.startswith("not recorded"), figure
        assert re.match(r"\d{4}-\d{2}-\d{2}", date), f"{figure}: no date"
        assert re.fullmatch(r"~?[\d.]+(-[\d.]+)?|quiet|not recorded", load), f"{figure}: {load}"
        loads = [float(x) for x in re.findall(r"[\d.]+", load)]
        if loads and max(loads) > 2:
            assert "under load" in value, f"{figure}: taken at load {load}, not marked"
