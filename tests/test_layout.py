"""The house is one-way: no import cycle inside tracer/, tracer never imports rollout, readers
never import a backend, only the public API imports the hot path, and config is a leaf.

Imports are read from the source with ``ast``, at any depth (a lazy import inside a function
is still an arrow), except under ``if TYPE_CHECKING:``, which never runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests._markdown import doc_tables

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_API = {"tracer", "tracer.verl_compat", "tracer.testing"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, package: str) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            # `from tracer import current` imports the module tracer.current; `from tracer.x
            # import f` imports tracer.x: marked with "|" and resolved in import_graph
            found.update(f"{module}|{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(top: str) -> dict[str, set[str]]:
    files = sorted((ROOT / top).rglob("*.py"))
    modules = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for target in _imports(ast.parse(path.read_text()), package):
            module, _, attr = target.partition("|")
            targets.add(f"{module}.{attr}" if f"{module}.{attr}" in modules else module)
        graph[name] = {t for t in targets if t in modules and t != name}
        graph[name] |= {t for t in targets if t.split(".")[0] != top and t.split(".")[0] in
                        ("rollout", "benchmarks")}  # fmt: skip
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_no_import_cycle_inside_tracer() -> None:
    # the package itself (tracer/__init__) is the public API on top: edges *to* it from its
    # own modules would be cycles too, so it stays in the graph
    assert _cycles(import_graph("tracer")) == []


def test_tracer_never_imports_rollout_or_benchmarks() -> None:
    leaks = {m: sorted(t for t in ts if t.startswith(("rollout", "benchmarks")))
             for m, ts in import_graph("tracer").items()}  # fmt: skip
    assert {m: ts for m, ts in leaks.items() if ts} == {}


def test_readers_never_import_a_backend() -> None:
    graph = import_graph("tracer")
    bad = {m: sorted(t for t in ts if t.startswith("tracer.backends"))
           for m, ts in graph.items() if m.startswith("tracer.readers")}  # fmt: skip
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_only_the_public_api_imports_the_hot_path() -> None:
    graph = import_graph("tracer")
    importers = sorted(m for m, ts in graph.items() if "tracer.ops" in ts)
    assert set(importers) <= PUBLIC_API, importers


def test_config_and_the_trajectory_types_are_leaves() -> None:
    graph = import_graph("tracer")
    # config asks two leaves: the value rules and the backend names
    assert graph["tracer.config"] == {"tracer.config_values", "tracer.backend_registry"}
    assert graph["tracer.config_values"] == set() and graph["tracer.backend_registry"] == set()
    assert graph["tracer.current"] == set()
    assert graph["tracer.trajectory"] <= {"tracer.ids", "tracer.attempts"}
    assert graph["tracer.attempts"] == set() and graph["tracer.ids"] == set()


def test_the_cycle_check_can_fail() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\nimport y")
    assert "x" not in _imports(tree, "pkg") and "y" in _imports(tree, "pkg")
    graph = import_graph("tracer")
    assert "tracer.current" in graph["tracer.core"] and "tracer" not in graph["tracer.core"]


def test_the_explorer_is_a_reader() -> None:
    """tracer/readers/explore/ reads exports: no backend, no hot path, nothing of rollout/
    (the command line on top of it is rollout/explore_cli.py); rollout/ keeps only the demo
    rollout and the commands."""
    graph = import_graph("tracer")
    explorer = {m: ts for m, ts in graph.items() if m.startswith("tracer.readers.explore")}
    assert {"tracer.readers.explore.server", "tracer.readers.explore.store"} <= set(explorer)
    reaches = set().union(*explorer.values())
    assert not {t for t in reaches if t.startswith(("rollout", "tracer.backends"))}
    assert not reaches & {"tracer.ops", "tracer.core", "tracer.pipeline"}
    assert not (ROOT / "rollout" / "explore").exists()
    assert (ROOT / "tracer" / "readers" / "explore" / "static" / "explore.html").is_file()
    assert "rollout.explore_cli" in import_graph("rollout")["rollout.cli"]


# the commands that read what the tracer stored; `run` (cli.py, ray_cli.py) is the demo rollout
READER_COMMANDS = {"rollout.export_cli", "rollout.flags_cli", "rollout.explore_cli",
                   "rollout.replay_cli", "rollout.ui"}  # fmt: skip


def test_the_reader_commands_need_nothing_of_the_demo_rollout() -> None:
    """`rollout-tracer export`, `report`, `flags`, `explore`, `replay` and `ui` live in
    rollout/ only as command lines: what they read with is in tracer/ (the tokenizer too,
    tracer/readers/tokenizers.py), never the demo's models, engines or rewards."""
    graph = import_graph("rollout")
    assert set(graph) >= READER_COMMANDS
    demo = {m: sorted(t for t in graph[m] if t.startswith("rollout") and t not in
                      READER_COMMANDS | {"rollout.extras"}) for m in READER_COMMANDS}  # fmt: skip
    assert {m: ts for m, ts in demo.items() if ts} == {}


def test_no_import_cycle_inside_benchmarks() -> None:
    """A benchmark may use another's helpers, never both ways (bench_patterns.py and explore.py
    share benchmarks/explorer_http.py instead of importing each other)."""
    assert _cycles(import_graph("benchmarks")) == []


# ---- every module by its path, its size, and the one allowlist ----------------------------------

# Modules allowed over 400 lines, and why. Drop an entry when its file is split; a stale entry
# (the file is gone or back under 400) fails too.
OVER_400 = {
    "tracer/snapshot.py": "the hot path's argument snapshot: the JSON-bytes fast path and the "
    "object walk call each other on every value (one recursion); benchmarks/hotpath.py times it",
    "tracer/readers/explore/store.py": "the explorer's DuckDB queries over one set of views and "
    "one cache: every method is a query on the same attached runs; over by a few lines",
    "tracer/readers/explore/server.py": "the explorer's HTTP routes and the handler that serves "
    "them; the routes already call store.py and the views: over by a few lines",
}
LIMIT = 400



def layout_table() -> dict[str, int]:
    import re

    tables = doc_tables()
    rows = re.findall(r"^\| `([^`]+)` \| (\d+) \|", tables.block(tables.LAYOUT.read_text(),
                                                               "modules"), re.M)  # fmt: skip
    return {path: int(lines) for path, lines in rows}


def test_the_layout_page_names_every_module_by_its_path() -> None:
    """A path, not a word: `steps` in prose does not name tracer/readers/explore/steps.py."""
    table, code = layout_table(), doc_tables().modules()
    fix = " (run `python scripts/doc_tables.py`)"
    assert sorted(set(code) - set(table)) == [], "modules missing from docs/layout.md" + fix
    assert sorted(set(table) - set(code)) == [], "docs/layout.md names modules that are gone" + fix


def test_the_layout_pages_line_counts_are_close() -> None:
    table, code = layout_table(), doc_tables().modules()
    off = {path: (table[path], lines) for path, lines in code.items()
           if path in table and abs(table[path] - lines) > max(40, lines // 5)}  # fmt: skip
    assert off == {}, "docs/layout.md's (page, code) line counts; run python scripts/doc_tables.py"


def test_the_layout_page_says_what_each_module_and_reader_package_does() -> None:
    """The module table's third column and the readers map are the docstrings, as the code
    has them now; a reader package without a docstring has no answer to show."""
    import re

    tables = doc_tables()
    page = tables.LAYOUT.read_text()
    missing = [p.relative_to(ROOT).as_posix() for p in tables.reader_packages()
               if not tables.summary(p / "__init__.py")]  # fmt: skip
    assert missing == [], "reader packages without a docstring saying what they answer"
    assert {"readers/habits/", "readers/timing/", "readers/explore/"} <= set(
        re.findall(r"^(readers/\S*)", tables.block(page, "readers"), re.M))
    fix = ": run python scripts/doc_tables.py"
    assert tables.block(page, "readers") == tables.readers_block() + "\n", "readers map" + fix
    shown = dict(re.findall(r"^\| `([^`]+)` \| \d+ \| (.*) \|$", tables.block(page, "modules"),
                            re.M))  # fmt: skip
    stale = sorted(p for p, said in shown.items()
                   if (ROOT / p).is_file() and said != tables.summary(ROOT / p))  # fmt: skip
    assert stale == [], "module descriptions differ from their docstrings" + fix


def test_every_file_the_layout_page_names_exists() -> None:
    """The hand-written parts (the import diagram, rollout/, benchmarks/): a `name.py` or
    `name.js` that no file in the tree has is a module that was renamed or removed."""
    import re

    names = {p.name for top in ("tracer", "rollout", "benchmarks", "scripts", "tests", "config",
                                "examples")
             for p in (ROOT / top).rglob("*") if p.is_file()}  # fmt: skip
    # the generated blocks quote docstrings, which may name other projects' files
    text = re.sub(r"<!-- begin (\S+) -->.*?<!-- end \1 -->", "", doc_tables().LAYOUT.read_text(),
                  flags=re.S)  # fmt: skip
    named = set(re.findall(r"(?<![\w.-])([a-z_][\w]*\.(?:py|js|html))\b", text))
    assert sorted(named - names) == []


def test_rooms_under_400_lines_or_in_the_allowlist() -> None:
    code = doc_tables().modules()
    over = sorted(path for path, lines in code.items() if lines > LIMIT and path not in OVER_400)
    assert over == [], f"over {LIMIT} lines: split them along a seam (or say why in OVER_400)"
    stale = sorted(p for p in OVER_400 if code.get(p, 0) <= LIMIT)
    assert stale == [], f"in OVER_400 but gone or under {LIMIT} lines: drop them from the list"
    assert all(reason.strip() for reason in OVER_400.values())


def test_the_layout_checks_can_fail(tmp_path: Path) -> None:
    tables = doc_tables()
    page = "x\n<!-- begin modules -->\n| `tracer/a.py` | 10 |\n<!-- end modules -->\n"
    assert tables.block(page, "modules") == "| `tracer/a.py` | 10 |\n"
    rewritten = tables.rewrite(page, "modules", "| `tracer/b.py` | 20 |")
    assert "tracer/b.py" in rewritten and "tracer/a.py" not in rewritten
    assert ["a", "b", "a"] in _cycles({"a": {"b"}, "b": {"a"}})
