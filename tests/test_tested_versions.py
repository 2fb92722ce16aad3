"""README's "Versions: yours stay" against what the project states and what CI installs: the
ranges in pyproject.toml, the low-end pins in .ci/constraints-lowest.txt, and .ci/run (#55)."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
# extras that are the project's own tooling, not installed into a user's environment
NOT_USERS = {"test", "all"}


def _extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in extras.items()}


def _readme_rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    table = text.split("<!-- tested-versions -->")[1].split("<!-- /tested-versions -->")[0]
    rows = [[cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
            for line in table.strip().splitlines()[2:]]  # fmt: skip
    assert rows and all(len(row) == 5 for row in rows), rows
    return rows


def _lowest_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / ".ci" / "constraints-lowest.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def _requirement(extra: str, package: str) -> Requirement:
    name = canonicalize_name(package)
    [req] = [r for r in _extras()[extra] if canonicalize_name(r.name) == name]
    return req


def _low_end(req: Requirement) -> Version:
    lows = [Version(s.version) for s in req.specifier if s.operator == ">="]
    assert len(lows) == 1, f"{req}: one >= bound expected"
    return lows[0]


def test_every_extra_a_user_installs_states_a_range_not_a_pin() -> None:
    users = {extra: reqs for extra, reqs in _extras().items() if extra not in NOT_USERS}
    pinned = [f"{extra}: {req}" for extra, reqs in users.items() for req in reqs
              if any(spec.operator in ("==", "===") for spec in req.specifier)]  # fmt: skip
    assert pinned == []


def test_readme_ranges_are_pyprojects() -> None:
    for package, extra, spec, _, _ in _readme_rows():
        req = _requirement(extra, package)
        assert req.specifier == Requirement(f"{package}{spec}").specifier, (package, str(req))


def test_readme_lowest_tested_are_the_constraints_pins_at_the_low_end_of_each_range() -> None:
    pins = _lowest_pins()
    readme = {canonicalize_name(row[0]): row for row in _readme_rows()}
    assert {name: readme[name][3] for name in pins} == pins
    assert [name for name, row in readme.items() if row[3] and name not in pins] == []
    for name, version in pins.items():
        req = _requirement(readme[name][1], name)
        assert Version(version) == _low_end(req), (name, version, str(req))


def test_ci_installs_the_lowest_venv_and_pins_no_ranged_package_in_the_main_one() -> None:
    run = (ROOT / ".ci" / "run").read_text()
    assert "in_background lowest bash scripts/setup_lowest.sh" in run
    assert ".venv-lowest/bin/python -m pytest" in run
    setup = (ROOT / "scripts" / "setup_lowest.sh").read_text()
    assert ".ci/constraints-lowest.txt" in setup
    for package, *_ in _readme_rows():
        assert not re.search(rf"\b{re.escape(package)}==", run, re.IGNORECASE), package


def test_tracer_trl_calls_the_tested_range_what_ci_tests() -> None:
    """tracer.trl warns outside TESTED_TRL; its low end is CI's lowest TRL."""
    import tracer.trl

    low = _lowest_pins()["trl"]
    assert tracer.trl.TESTED_TRL[0] == ".".join(low.split(".")[:2])
    tested = [v for v in ("1.7.1", "1.8.0", "1.12.2", "1.16.0", "1.17.0", "2.0.0")
              if tracer.trl._in_tested_range(v)]  # fmt: skip
    assert tested == ["1.8.0", "1.12.2", "1.16.0"]
