"""Rewrite the generated blocks of the docs from the code: docs/layout.md's module table (every
module under tracer/, rollout/, benchmarks/ with its line count and its docstring's first
sentence) and its readers map (each package under tracer/readers/ with its docstring and
modules), and the signatures in docs/api.md (one per name in ``tracer.__all__``).

    python scripts/doc_tables.py          # rewrite both blocks in place
    python scripts/doc_tables.py --check  # exit 1 when a block is not what the code makes

A block sits between ``<!-- begin NAME -->`` and ``<!-- end NAME -->``; everything outside the
markers is written by hand. tests/test_layout.py and tests/test_api_doc.py check what these
functions compute, so a page cannot drift from the code without a failing test.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ROOT / "docs" / "layout.md"
API = ROOT / "docs" / "api.md"
MODULE_ROOTS = ("tracer", "rollout", "benchmarks")


def modules() -> dict[str, int]:
    """Every Python module under tracer/, rollout/, benchmarks/ -> its line count."""
    found = {}
    for top in MODULE_ROOTS:
        for path in sorted((ROOT / top).rglob("*.py")):
            found[path.relative_to(ROOT).as_posix()] = path.read_text().count("\n")
    return found


def summary(path: Path) -> str:
    """The first sentence of a module's docstring, on one line ("" when it has none)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    sentence = re.split(r"(?<=[a-z0-9)`'])\.(?:\s|$)", first, maxsplit=1)[0].rstrip(".")
    return sentence.replace("``", "`").replace("|", "\\|")


def layout_block() -> str:
    rows = [f"| `{path}` | {lines} | {summary(ROOT / path)} |" for path, lines in modules().items()]
    return "\n".join(["| module | lines | what it does |", "|---|---:|---|", *rows])


def reader_packages() -> list[Path]:
    """tracer/readers/ and each package inside it: the readers, grouped by the question each
    answers."""
    readers = ROOT / "tracer" / "readers"
    return [readers, *sorted(p.parent for p in readers.glob("*/__init__.py"))]


def readers_block() -> str:
    """The readers map: per package its docstring's first sentence and its modules."""
    import textwrap

    lines = []
    for package in reader_packages():
        name = package.relative_to(ROOT / "tracer").as_posix() + "/"
        names = sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py")
        for text, first in ((summary(package / "__init__.py"), f"{name:<18}"),
                            ("modules: " + "  ".join(names), " " * 18)):  # fmt: skip
            lines += textwrap.wrap(text, 96, initial_indent=first, subsequent_indent=" " * 18)
    return "```\n" + "\n".join(lines) + "\n```"


def signature_of(name: str) -> str:
    """``name``'s signature as the code declares it: a function's, a class's constructor
    (``TraceConfig``: its fields, which docs/configuration.md lists; ``RolloutTraceConfig``:
    verl's ``init``), an exception's base, a constant's value. Long ones one parameter a line."""
    import dataclasses

    import tracer

    obj = getattr(tracer, name)
    if name == "TraceConfig":
        return "class TraceConfig(**fields)  # every field: docs/configuration.md"
    if name == "RolloutTraceConfig":
        return "class RolloutTraceConfig  # a singleton, as verl's\n" + _wrap(
            "RolloutTraceConfig.init", inspect.signature(obj.init)
        )
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        return f"class {name}({obj.__mro__[1].__name__})"
    if inspect.isclass(obj):
        kind = "@dataclass\nclass" if dataclasses.is_dataclass(obj) else "class"
        sig = inspect.signature(obj).replace(return_annotation=inspect.Signature.empty)
        return f"{kind} " + _wrap(name, sig)
    if callable(obj):
        return _wrap(name, inspect.signature(obj))
    return f"{name} = {obj!r}"


def _wrap(name: str, sig: inspect.Signature) -> str:
    params, kinds = [], [p.kind for p in sig.parameters.values()]
    for i, p in enumerate(sig.parameters.values()):
        if (
            p.kind is p.KEYWORD_ONLY
            and p.VAR_POSITIONAL not in kinds
            and (i == 0 or kinds[i - 1] is not p.KEYWORD_ONLY)
        ):
            params.append("*")
        params.append(_param(p))
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(kinds) or kinds[i + 1] is not p.kind):
            params.append("/")
    ret = sig.return_annotation
    ret = "" if ret is inspect.Signature.empty else f" -> {_annotation(ret)}"
    one = f"{name}({', '.join(params)}){ret}"
    if len(one) <= 95:
        return one
    return f"{name}(\n" + "".join(f"    {p},\n" for p in params) + f"){ret}"


def _param(p: inspect.Parameter) -> str:
    stars = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
    text = stars + p.name
    if p.annotation is not p.empty:
        text += f": {_annotation(p.annotation)}"
    if p.default is not p.empty:
        default = p.default
        shown = default.__name__ if callable(default) and hasattr(default, "__name__") else (
            repr(default))  # fmt: skip
        text += (" = " if p.annotation is not p.empty else "=") + shown
    return text


def _annotation(annotation: object) -> str:
    # modules use `from __future__ import annotations`: annotations are the source's strings
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def api_names() -> list[str]:
    import tracer

    return list(tracer.__all__)


def api_block(name: str) -> Callable[[], str]:
    return lambda: f"```text\n{signature_of(name)}\n```"


def blocks() -> dict[str, tuple[Path, Callable[[], str]]]:
    """Every generated block: its page and what writes it."""
    found: dict[str, tuple[Path, Callable[[], str]]] = {
        "modules": (LAYOUT, layout_block),
        "readers": (LAYOUT, readers_block),
    }
    for name in api_names():
        found[f"sig:{name}"] = (API, api_block(name))
    return found


def block(text: str, name: str) -> str:
    """The text between the markers of block ``name`` (with its last newline)."""
    match = re.search(rf"<!-- begin {name} -->\n(.*?)<!-- end {name} -->", text, re.S)
    if match is None:
        raise ValueError(f"no block {name!r} (<!-- begin {name} --> ... <!-- end {name} -->)")
    return match.group(1)


def rewrite(text: str, name: str, body: str) -> str:
    old = block(text, name)
    start = text.index(f"<!-- begin {name} -->\n") + len(f"<!-- begin {name} -->\n")
    return text[:start] + body + "\n" + text[start + len(old) :]


def main(argv: list[str]) -> int:
    stale, missing = [], []
    for name, (page, make) in blocks().items():
        text = page.read_text()
        try:
            new = rewrite(text, name, make())
        except ValueError as exc:
            missing.append(f"{page.relative_to(ROOT)}: {exc}")
            continue
        if new != text:
            stale.append(f"{page.relative_to(ROOT)} ({name})")
            if "--check" not in argv:
                page.write_text(new)
    if stale:
        verb = "is stale" if "--check" in argv else "rewritten"
        print(f"{verb}: {', '.join(stale)}")
    for line in missing:  # a new public name needs its section written by hand first
        print(line, file=sys.stderr)
    return 1 if missing or (stale and "--check" in argv) else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
