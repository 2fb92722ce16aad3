"""Reading the README and docs/*.md as the tests need them: fenced blocks with the heading above
them, shell commands, links, and the anchors a forge makes of headings (GitHub's rules)."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def doc_tables() -> ModuleType:
    """scripts/doc_tables.py (a script, not a package module), loaded once per process."""
    spec = importlib.util.spec_from_file_location("doc_tables", ROOT / "scripts" / "doc_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("doc_tables", module)
    spec.loader.exec_module(module)
    return module


def pages() -> list[Path]:
    """The README and every page under docs/."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def page_name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


_FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)


def fenced_blocks(text: str) -> list[tuple[str, str, str]]:
    """(language, the heading above it, the code) for each fenced block."""
    blocks = []
    for match in _FENCE.finditer(text):
        headings = re.findall(r"^#+ (.+)$", _FENCE.sub("", text[: match.start()]), re.M)
        blocks.append((match.group(1), headings[-1] if headings else "", match.group(2)))
    return blocks


def prose(text: str) -> str:
    """The text without its fenced blocks (a `#` inside a block is a comment, not a heading)."""
    return _FENCE.sub("", text)


def shell_commands(code: str) -> list[list[str]]:
    """The commands of a shell block, each as argv: continuation lines joined, comments
    dropped, split at `&&`, `;` and `|`, leading `VAR=value` assignments removed."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote: not a command this test can read
            continue
        current: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", ";", "|", "||", "&"):
                while current and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", current[0]):
                    current.pop(0)
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(word)
    return commands


def inline_commands(text: str, program: str) -> list[list[str]]:
    """`program ...` written as inline code in the prose."""
    found: list[list[str]] = []
    for span in re.findall(r"`([^`\n]+)`", prose(text)):
        if span.startswith(program + " "):
            found.extend(c for c in shell_commands(span) if c and c[0] == program)
    return found


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", prose(text), re.M):
        base = slug(heading)
        name, n = base, 0
        while name in found:  # GitHub numbers repeated headings: name, name-1, name-2
            n += 1
            name = f"{base}-{n}"
        found.add(name)
    return found


def links(text: str) -> list[str]:
    """Targets of Markdown links and images in the prose (not in code)."""
    text = re.sub(r"`[^`\n]*`", "", prose(text))  # nor in inline code
    return re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)


FIRST_SCREEN = 60


def first_screen() -> str:
    return "".join(README.read_text().splitlines(keepends=True)[:FIRST_SCREEN])


def first_screen_commands() -> list[list[list[str]]]:
    """Each command line of the first screen's shell blocks, as its `&&`-separated steps."""
    lines = []
    for lang, _, code in fenced_blocks(first_screen()):
        if lang == "bash":
            for line in code.splitlines():
                words = shlex.split(line, comments=True)
                if words:
                    steps: list[list[str]] = []
                    current: list[str] = []
                    for word in [*words, "&&"]:
                        if word == "&&":
                            steps.append(current)
                            current = []
                        else:
                            current.append(word)
                    lines.append(steps)
    return lines
