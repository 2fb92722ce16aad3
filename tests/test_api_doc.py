"""docs/api.md is tracer's public API: a section for every name in ``tracer.__all__`` and none
for a name that is gone, each with the signature the code has now (written between markers by
``python scripts/doc_tables.py``). Its examples run in tests/test_readme.py."""

from __future__ import annotations

import re

import pytest

import tracer
from tests._markdown import ROOT, doc_tables

API = ROOT / "docs" / "api.md"



def sections(text: str) -> list[str]:
    return re.findall(r"^### `([\w.]+)`$", text, re.M)


def test_every_public_name_has_a_section_and_no_section_is_stale() -> None:
    documented = sections(API.read_text())
    assert sorted(set(tracer.__all__) - set(documented)) == [], "public names without a section"
    assert sorted(set(documented) - set(tracer.__all__)) == [], "sections for names not exported"
    assert len(documented) == len(set(documented)), "a name documented twice"


@pytest.mark.parametrize("name", tracer.__all__)
def test_the_signature_is_the_codes(name: str) -> None:
    tables, text = doc_tables(), API.read_text()
    section = re.split(r"\n#+ ", text[text.index(f"### `{name}`\n") :], maxsplit=1)[0]
    assert f"<!-- begin sig:{name} -->" in section, f"{name}'s signature is not in its section"
    shown = tables.block(text, f"sig:{name}").strip()
    assert shown == tables.api_block(name)(), f"{name}: run python scripts/doc_tables.py"


def test_the_checks_can_fail() -> None:
    tables = doc_tables()
    assert sections("### `init`\ntext\n### `gone`\n") == ["init", "gone"]
    assert tables.signature_of("flush") == "flush(timeout_s: float | None = None) -> bool"
    assert "**fields" in tables.signature_of("TraceConfig")
    assert tables.signature_of("TracerInitError") == "class TracerInitError(RuntimeError)"
    assert tables.signature_of("SCHEMA_VERSION") == f"SCHEMA_VERSION = {tracer.SCHEMA_VERSION}"
