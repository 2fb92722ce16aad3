"""The first hour of a new user (issue 32): every usual mistake with the reading commands gets a
clear error, before any slow work (MLflow, pandas and pyarrow cannot even be imported in those
cases), with the right exit status, and no store, file or folder is created or changed.

The commands run in-process through ``rollout.cli.main`` over one small real store (MLflow
sqlite + JSONL: 12 training trajectories in steps 1-2, 12 validation ones in passes at steps 0
and 2), so MLflow is imported once."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tracer
from tests import export_agent

pytest.importorskip("mlflow")
pytest.importorskip("pyarrow")

from rollout.cli import main

# its module-scoped fixture is costly: the module runs on one worker, which sets it up once
pytestmark = pytest.mark.xdist_group("cli-first-hour")

PROJECT = "first-hour"
SLOW = ("mlflow", "pandas", "pyarrow", "sqlalchemy")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    jsonl = str(tmp / "traces.jsonl")
    tracer.init({"backend": ["mlflow", "jsonl"], "tracking_uri": uri, "jsonl_path": jsonl,
                 "project_name": PROJECT, "experiment_name": "grpo", "token2text": True,
                 "spool_dir": str(tmp / "spool"), "raise_internal_errors": True})  # fmt: skip
    tracer.register_tokenizer(export_agent.WordTokenizer())
    export_agent.run([1, 2])
    export_agent.run([0, 2], validate=True)
    assert tracer.flush(timeout_s=60)
    tracer.reset()
    good = tmp / "out_keep"
    assert main(["export", "--from", "mlflow", "--tracking-uri", uri, "--experiment", PROJECT,
                 "--out", str(good), "--no-progress"]) == 0  # fmt: skip
    yield {"uri": uri, "jsonl": jsonl, "good": good, "tmp": tmp}


def snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every folder under ``roots``, and every file with its size and modification time (a
    folder's own mtime moves when a command probes whether it can write there)."""
    seen: dict[str, tuple[int, int]] = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames:
                seen[os.path.join(dirpath, name)] = (0, 0)
            for name in filenames:
                st = os.stat(os.path.join(dirpath, name))
                seen[os.path.join(dirpath, name)] = (st.st_size, st.st_mtime_ns)
    return seen


@pytest.fixture
def no_slow_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any import of MLflow, pandas, pyarrow or SQLAlchemy now raises ImportError: a command
    that errs before slow work never gets there."""
    for name in list(sys.modules):
        if name.split(".")[0] in SLOW:
            monkeypatch.setitem(sys.modules, name, None)
    for name in SLOW:
        monkeypatch.setitem(sys.modules, name, None)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's own errors
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out + err


# (id, argv with {uri} {jsonl} {good} {tmp} placeholders, exit status, message parts, fast:
# the error comes before MLflow/pandas/pyarrow are imported)
CASES: list[tuple[str, list[str], int, list[str], bool]] = [
    ("export-experiment-typo", ["export", "--from", "mlflow", "--tracking-uri", "{uri}",
     "--experiment", "rollout_tracer", "--out", "{good}"], 2,
     ["no MLflow experiment named 'rollout_tracer'", "experiments there:", f"'{PROJECT}'"], True),
    ("export-jsonl-missing", ["export", "--from", "jsonl", "--path", "{tmp}/nope.jsonl",
     "--out", "{tmp}/new_out"], 2, ["--path", "nope.jsonl does not exist", "jsonl_path"], True),
    ("export-jsonl-missing-over-good", ["export", "--from", "jsonl", "--path", "{tmp}/nope.jsonl",
     "--out", "{good}"], 2, ["does not exist"], True),
    ("export-no-store-here", ["export", "--from", "mlflow", "--out", "{tmp}/new_out"], 2,
     ["no MLflow store at sqlite:///", "mlflow.db does not exist", "--tracking-uri"], True),
    ("export-store-in-missing-folder", ["export", "--from", "mlflow", "--tracking-uri",
     "sqlite:///{tmp}/nodir/x.db", "--out", "{tmp}/new_out"], 2,
     ["no MLflow store at sqlite:///", "nodir/x.db does not exist"], True),
    ("report-steps-abc", ["report", "--from", "jsonl", "--path", "{jsonl}", "--steps", "abc",
     "--out", "{tmp}/r.html"], 2, ["--steps", "expected FIRST:LAST", "e.g. 1:10"], True),
    ("report-steps-reversed", ["report", "--from", "jsonl", "--path", "{jsonl}", "--steps",
     "5:1", "--out", "{tmp}/r.html"], 2, ["--steps", "FIRST is after LAST", "1:5"], True),
    ("report-steps-absent", ["report", "--from", "jsonl", "--path", "{jsonl}", "--steps", "99",
     "--out", "{tmp}/r.html"], 1, ["no trajectories in", "--steps 99", "steps there: 0:2"],
     False),
    ("report-steps-absent-mlflow", ["report", "--from", "mlflow", "--tracking-uri", "{uri}",
     "--experiment", PROJECT, "--step", "99", "--out", "{tmp}/r.html"], 1,
     ["no trajectories in", "--steps 99", "steps there: 0:2"], True),
    ("export-jsonl-experiment-absent", ["export", "--from", "jsonl", "--path", "{jsonl}",
     "--experiment", "gsm8k", "--out", "{tmp}/new_out"], 1,
     ["no trajectories in", "--experiment gsm8k", f"experiments there: {PROJECT}, grpo"], False),
    ("report-out-unwritable", ["report", "--from", "mlflow", "--tracking-uri", "{uri}",
     "--experiment", PROJECT, "--out", "/proc/x.html"], 2, ["--out /proc/x.html"], True),
    ("report-out-missing-folder", ["report", "--from", "mlflow", "--tracking-uri", "{uri}",
     "--experiment", PROJECT, "--out", "{tmp}/nodir/r.html"], 2, ["does not exist"], True),
    ("report-out-is-folder", ["report", "--from", "mlflow", "--tracking-uri", "{uri}",
     "--experiment", PROJECT, "--out", "{good}"], 2, ["is a folder"], True),
    ("export-out-is-file", ["export", "--from", "jsonl", "--path", "{jsonl}", "--out",
     "{jsonl}"], 2, ["is a file"], True),
    ("report-parquet-missing", ["report", "--from", "parquet", "--path", "{tmp}/nope",
     "--out", "{tmp}/r.html"], 2, ["--path", "nope does not exist", "export"], True),
    ("report-jsonl-no-path", ["report", "--from", "jsonl", "--out", "{tmp}/r.html"], 2,
     ["--from jsonl needs --path"], True),
    ("flags-write-tags-parquet", ["flags", "--from", "parquet", "--path", "{good}",
     "--write-tags"], 2, ["--write-tags", "needs --from mlflow"], True),
    ("flags-no-store-here", ["flags", "--from", "mlflow"], 2, ["no MLflow store at"], True),
]


@pytest.mark.parametrize(("argv", "status", "message", "fast"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])  # fmt: skip
def test_a_mistake_is_a_clear_error_that_changes_nothing(
    argv: list[str], status: int, message: list[str], fast: bool, store: dict[str, Any],
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    places = {k: str(v) for k, v in store.items()} | {"tmp": str(tmp_path)}
    argv = [a.format(**places) for a in argv]
    if argv[0] in ("export", "report"):
        argv.append("--no-progress") if argv[0] == "export" else None
    before = snapshot(store["tmp"], tmp_path)
    if fast:
        request.getfixturevalue("no_slow_imports")
    got, text = run_cli(argv, capsys)
    assert got == status, text
    for part in message:
        assert part in text, text
    assert "Traceback" not in text
    assert snapshot(store["tmp"], tmp_path) == before  # nothing created, nothing changed


def test_a_failed_export_keeps_the_previous_one(store: dict[str, Any], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The export itself fails half way (the source raises on its second page): the
    previous tables stay as they were, and no staging file is left behind."""
    import pyarrow.parquet as pq

    from tracer.readers import export_pages, iter_records

    good = store["good"]
    before = snapshot(good)
    pages = iter_records("jsonl", path=store["jsonl"], page_size=2)

    def failing() -> Iterator[Any]:
        yield next(pages)
        raise OSError("the disk went away")

    with pytest.raises(OSError, match="disk went away"):
        export_pages(failing(), str(good))
    assert snapshot(good) == before
    assert pq.read_table(good / "trajectories.parquet").num_rows == 24
    with pytest.raises(OSError):
        export_pages(failing(), str(tmp_path / "fresh"))
    assert not (tmp_path / "fresh").exists()  # the folder it created is gone again


def test_a_report_is_replaced_only_when_complete(store: dict[str, Any], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from tracer.readers import read_tables, report, write_report

    out = tmp_path / "report.html"
    out.write_text("the previous report")
    tables = read_tables("jsonl", path=store["jsonl"])

    def broken(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("a bug while rendering")

    monkeypatch.setattr(report, "build_report", broken)
    with pytest.raises(RuntimeError):
        write_report(tables, str(out))
    assert out.read_text() == "the previous report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


# ----------------------------------------------------------------------------------- report
def test_the_report_counts_training_and_validation_apart(
    store: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.html"
    status, text = run_cli(["report", "--from", "parquet", "--path", str(store["good"]),
                            "--out", str(out)], capsys)  # fmt: skip
    assert status == 0, text
    assert "12 training and 12 validation trajectories" in text
    html = out.read_text()
    assert f"<title>Rollout report: {PROJECT} / grpo</title>" in html
    assert '<span id="n-steps">2</span> training steps' in html
    assert '<span id="n-traj">12</span> training trajectories' in html
    assert '<span id="n-val-passes">2</span> validation passes' in html
    # training panels: steps 1 and 2 only (step 0 held validation only), 6 trajectories each
    rewards = html[html.index('id="rewards"'):html.index('id="trends"')]
    assert re.findall(r'<tr data-step="(\d+)"><td>\d+</td><td>(\d+)</td>', rewards) == [
        ("1", "6"), ("2", "6")]
    validation = html[html.index('id="validation"'):html.index('id="groups"')]
    assert re.findall(r'<tr data-step="(\d+)"><td>\d+</td><td>(\d+)</td>', validation) == [
        ("0", "6"), ("2", "6")]
    assert "validation mean reward" in validation  # its own curve
    # every table has a header row, the GRPO group tables included
    groups = html[html.index('id="groups"'):html.index('id="prompts"')]
    assert groups.count("<table") == groups.count("<thead>") == 2
    assert "<th>rollout 0</th><th>rollout 1</th>" in groups
    assert html.count("<table") == html.count("<thead>")


def test_small_reward_differences_get_clearly_different_colours() -> None:
    from tracer.readers.svg import RewardColors

    colors = RewardColors([0.0, 0.05, 1.05, 1.1, 0.05])

    def rgb(v: float) -> list[int]:
        return [int(x) for x in colors(v)[4:-1].split(",")]

    for a, b in [(0.0, 0.05), (1.05, 1.1), (0.05, 1.05)]:
        distance = sum((x - y) ** 2 for x, y in zip(rgb(a), rgb(b), strict=True)) ** 0.5
        assert distance > 80, (a, b, colors(a), colors(b))
    assert colors(None) == "#e5e7eb" and "0.05" in colors.legend()


CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium")
def test_special_tokens_are_hidden_in_transcripts_with_a_toggle(
    store: dict[str, Any], tmp_path: Path
) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    from tracer.readers import read_tables, write_report

    tables = read_tables("parquet", path=str(store["good"]))
    first = tables.trajectories.sort_values(["step", "sample_key", "rollout_n"]).iloc[0]
    turns = tables.turns
    mine = turns.index[turns["trace_id"] == first["trace_id"]]
    turns.loc[mine, "response_text"] = "The answer.<|im_end|>"
    tables.tokens = tables.tokens.iloc[0:0]  # the text view (a token view hides them alike)
    out = write_report(tables, str(tmp_path / "r.html"))
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu"])  # fmt: skip
        page = browser.new_page()
        page.goto(Path(out).as_uri())
        box = page.locator("#transcript")
        assert "The answer." in box.text_content()
        assert "<|im_end|>" not in box.text_content()
        page.check("#show-special")
        assert "The answer.<|im_end|>" in box.text_content()
        browser.close()


# ----------------------------------------------------------------------------------- replay
def _spool_folder(root: Path, meta: dict[str, Any], lines: list[str]) -> Path:
    import json

    folder = root / f"{meta['backend']}-0123456789ab"
    folder.mkdir(parents=True)
    (folder / "destination.json").write_text(json.dumps(meta))
    (folder / f"1700000000000000000_gonehost_1_x_0_{len(lines)}.jsonl").write_text(
        "".join(line + "\n" for line in lines))
    return folder


@pytest.mark.usefixtures("no_slow_imports")
@pytest.mark.parametrize("kind", ["missing", "file", "not-a-spool"])
def test_replay_of_a_wrong_folder_is_an_error(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "spool"
    if kind == "file":
        target.write_text("x")
    elif kind == "not-a-spool":
        target.mkdir()
        (target / "notes.txt").write_text("x")
    before = snapshot(tmp_path)
    status, text = run_cli(["replay", "--spool-dir", str(target)], capsys)
    assert status == 2, text
    assert "--spool-dir" in text or "not a spool folder" in text, text
    assert snapshot(tmp_path) == before


@pytest.mark.usefixtures("no_slow_imports")
@pytest.mark.parametrize("case", ["moved", "gone"])
def test_replay_reports_a_moved_or_missing_store_before_sending(
    case: str, store: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    old, new = tmp_path / "old-clone", tmp_path / "new-clone"
    old.mkdir()
    new.mkdir()
    (new / "mlflow.db").write_bytes(b"")  # this clone's own store
    if case == "moved":
        (old / "mlflow.db").write_bytes(b"")
    uri = f"sqlite:///{old / 'mlflow.db'}"
    lines = Path(store["jsonl"]).read_text().splitlines()[:2]
    _spool_folder(new / ".rollout-tracer" / "spool",
                  {"backend": "mlflow", "destination": f"{uri}#1",
                   "config": {"tracking_uri": uri}}, lines)  # fmt: skip
    monkeypatch.chdir(new)
    before = snapshot(tmp_path)
    status, text = run_cli(["replay", "--no-progress"], capsys)
    assert status == 1, text
    assert f"mlflow -> {uri}: NOT SENT (1 batches stay in" in text
    if case == "moved":
        assert f"has its own {new / 'mlflow.db'}" in text and "--tracking-uri" in text
    else:
        assert "no longer exists" in text
    assert snapshot(tmp_path) == before  # nothing sent, nothing deleted


def test_replay_names_the_destination(
    store: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "replayed.jsonl"
    lines = Path(store["jsonl"]).read_text().splitlines()[:3]
    _spool_folder(tmp_path / "spool", {"backend": "jsonl", "destination": str(out),
                                       "config": {"jsonl_path": str(out)}}, lines)  # fmt: skip
    status, text = run_cli(["replay", "--spool-dir", str(tmp_path / "spool"), "--no-progress"],
                           capsys)  # fmt: skip
    assert status == 0, text
    assert f"jsonl -> {out}: 1 batches to replay" in text
    assert f"jsonl -> {out}: 3 trajectories replayed" in text
    assert len(out.read_text().splitlines()) == 3


def test_replay_destinations_carry_no_credentials() -> None:
    from tracer.replay import destination_of

    meta = {"backend": "mlflow", "destination": "http://h:5000#3",
            "config": {"tracking_uri": "http://user:secret@h:5000"}}  # fmt: skip
    assert destination_of(meta) == "http://h:5000"
    assert destination_of({"backend": "mlflow", "destination": "http://h:5000#3"}) == \
        "http://h:5000"  # a layout without the config: read defensively
    assert destination_of(meta, {"tracking_uri": "https://u:p@new:443"}) == "https://new:443"


# ------------------------------------------------------------------------------------- help
def test_help_is_for_users(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from rollout.cli import build_parser

    status, text = run_cli(["--help"], capsys)
    assert status == 0 and "SUBCOMMANDS" not in text and ":data:" not in text
    assert "rollout-tracer export --from mlflow" in text
    status, text = run_cli(["--version"], capsys)
    assert status == 0 and text.startswith("rollout-tracer ")
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        assert command.description, name
        for action in command._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"{name} {action.option_strings or action.dest}: no help"
    defaults = {name: next((a.help for a in command._actions if "--experiment" in
                            a.option_strings), None) for name, command in sub.choices.items()}
    assert all("default" in h and "rollout-tracer" in h for h in defaults.values() if h)
    assert {n for n, h in defaults.items() if h} == {"export", "report", "flags", "ui", "explore"}


def test_flags_prints_mlflow_ids_meanings_and_validation(
    store: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    status, text = run_cli(["flags", "--from", "parquet", "--path", str(store["good"])],
                           capsys)  # fmt: skip
    assert status == 0, text
    from tracer.readers.health import MEANINGS

    assert "health flags in 24 trajectories" in text
    shown = [name for name in MEANINGS if f"  {name} " in text]
    assert shown, text
    for name in shown:
        assert MEANINGS[name] in text
    ids = re.findall(r"^ {6}(\S+)  \(step (\d+), (training|validation)\)$", text, re.M)
    assert ids and all(i.startswith("tr-") and len(i) == 35 for i, _, _ in ids), text
