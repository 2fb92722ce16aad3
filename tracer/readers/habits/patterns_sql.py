"""The grouping behind :mod:`tracer.readers.habits.patterns`, in DuckDB: one scan of the
``trajectories`` table gives, per (step, signature), the counts and sums the rules need, and
per step the same over all trajectories.

Only the signatures that matter come back: those among a step's ``top`` or with at least
``min_count`` trajectories in some step (the others can neither be shown nor flagged). A run
of free-form answers has about one signature per trajectory, and those stay inside DuckDB.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tracer.readers.habits.earned import EarnedThresholds, sql_correctness, sql_unearned


class NoSignatures(ValueError):
    """The table has no ``signature`` column: an export written before signatures existed."""


@dataclass(kw_only=True)
class Counts:
    """Trajectories counted, with the sums their reward, length and correctness means come
    from (``n_checked``: with correctness; ``n_unearned``: unearned, ``n_unjudged``: with
    correctness and a reward but no correct answer to compare with; readers/habits/earned.py)."""

    n: int = 0
    n_reward: int = 0  # trajectories with a reward
    reward_sum: float = 0.0
    reward_sq: float = 0.0
    n_len: int = 0  # trajectories with a length
    len_sum: float = 0.0
    n_checked: int = 0
    correct_sum: float = 0.0
    n_unearned: int = 0
    n_unjudged: int = 0

    def add(self, reward: float | None, length: float | None, correct: float | None = None,
            unearned: bool | None = None) -> None:  # fmt: skip
        self.n += 1
        if reward is not None:
            self.n_reward += 1
            self.reward_sum += reward
            self.reward_sq += reward * reward
        if length is not None:
            self.n_len += 1
            self.len_sum += length
        if correct is not None:
            self.n_checked += 1
            self.correct_sum += correct
        self.n_unearned += bool(unearned)
        self.n_unjudged += correct is not None and reward is not None and unearned is None

    def merge(self, other: Counts) -> None:
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def reward_mean(self) -> float | None:
        return self.reward_sum / self.n_reward if self.n_reward else None

    @property
    def correct_mean(self) -> float | None:
        return self.correct_sum / self.n_checked if self.n_checked else None

    @property
    def reward_std(self) -> float | None:
        mean = self.reward_mean
        if mean is None:
            return None
        return max(self.reward_sq / self.n_reward - mean * mean, 0.0) ** 0.5


_SUMMED = ("n", "n_reward", "reward_sum", "reward_sq", "n_len", "len_sum", "n_checked",
           "correct_sum", "n_unearned", "n_unjudged")  # fmt: skip


@dataclass
class StepTotal(Counts):
    """All training trajectories of one step (``calls``: their tool calls), and the
    validation pass at that step (``val_n`` trajectories, their reward ``val_sum``) over the
    prompts every validation pass of the run has, and its squares ``val_sq``)."""

    step: int
    calls: int = 0
    val_n: int = 0
    val_sum: float = 0.0
    val_sq: float = 0.0


@dataclass
class Group(Counts):
    """The trajectories of one step with one signature."""

    step: int
    signature: str
    text: str
    calls: int = 0  # tool calls, all of them
    errors: int = 0  # tool calls that failed
    example: str = ""  # the smallest trace id: the same in every reading of the same data
    prompts: int = 0  # distinct prompts (else sample keys)
    answers: int = 0  # distinct response texts
    template: str = ""  # the exact-template signature text of its example (the finer level)
    repeated: float | None = None  # near-duplicate answers to other prompts (near_dup.py)


COLUMNS = ("trace_id", "step", "validate", "signature", "signature_text", "reward",
           "response_tokens", "response_text", "num_tool_calls", "num_tool_errors", "prompt",
           "sample_key", "accuracy", "reward_parts", "behaviour")  # fmt: skip


def _double(column: str) -> str:
    # pandas keeps a missing number as NaN, which DuckDB would average as a number
    return (f"(CASE WHEN isnan(CAST({column} AS DOUBLE)) THEN NULL "
            f"ELSE CAST({column} AS DOUBLE) END)")  # fmt: skip


def _rows(names: set[str], earned_by: str | None) -> str:
    """The view ``t``: one row per training trajectory, grouped by its behaviour (the
    signature in an export written before behaviours existed)."""
    key = "behaviour" if "behaviour" in names else "signature"
    correct = _double(sql_correctness(names, earned_by))
    paid, unearned = sql_unearned("t0", "correct", EarnedThresholds())
    return f"""
CREATE TEMP VIEW t0 AS
SELECT trace_id, CAST(step AS BIGINT) AS step, {key} AS signature,
       {"behaviour" if key == "behaviour" else "signature_text"} AS signature_text,
       signature_text AS template, {_double("reward")} AS reward,
       coalesce({_double("response_tokens")}, CAST(length(response_text) AS DOUBLE)) AS len,
       coalesce({_double("num_tool_calls")}, 0) AS calls,
       coalesce({_double("num_tool_errors")}, 0) AS errors,
       coalesce(prompt, sample_key) AS prompt, sample_key, response_text, {correct} AS correct
FROM src
WHERE step IS NOT NULL AND NOT isnan(CAST(step AS DOUBLE)) AND NOT coalesce(validate, false)
  AND {key} IS NOT NULL;
CREATE TEMP VIEW t AS
WITH {paid} SELECT t0.*, coalesce({unearned}, false) AS unearned, paid IS NULL AS unjudged
FROM t0 JOIN paid USING (step)
"""


_SUMS = ("count(*) AS n, count(reward) AS n_reward, coalesce(sum(reward), 0) AS reward_sum, "
         "coalesce(sum(reward * reward), 0) AS reward_sq, count(len) AS n_len, "
         "coalesce(sum(len), 0) AS len_sum, count(correct) AS n_checked, "
         "coalesce(sum(correct), 0) AS correct_sum, "
         "count(*) FILTER (WHERE unearned) AS n_unearned, "
         "count(*) FILTER (WHERE unjudged AND correct IS NOT NULL AND reward IS NOT NULL) "
         "AS n_unjudged")  # fmt: skip
_TOTALS = ("s_n", "s_n_reward", "s_reward_sum", "s_reward_sq", "s_n_len", "s_len_sum",
           "s_n_checked", "s_correct_sum", "s_n_unearned", "s_n_unjudged")  # fmt: skip
# One scan groups every trajectory by (step, behaviour), with the step's totals alongside; a
# second reads only the rows of the groups kept, for their distinct prompts and responses
# (64-bit hashes: cheaper than the texts; NULL is no value, as in Python) and their text.
_GROUPS = f"""
WITH g AS (
  SELECT step, signature, {_SUMS}, sum(calls) AS calls, sum(errors) AS errors,
         min(trace_id) AS example
  FROM t GROUP BY step, signature),
r AS (SELECT *, row_number() OVER (PARTITION BY step ORDER BY n DESC, signature) AS rank,
             {", ".join(f"sum({c[2:]}) OVER w AS {c}" for c in _TOTALS)},
             sum(calls) OVER w AS s_calls
      FROM g WINDOW w AS (PARTITION BY step)),
keep AS (SELECT signature FROM r GROUP BY signature HAVING min(rank) <= $top
         OR max(n) >= $min_count),
d AS (SELECT step, signature, min(signature_text) AS text,
             count(DISTINCT hash(prompt)) FILTER (WHERE prompt IS NOT NULL) AS prompts,
             count(DISTINCT hash(response_text)) FILTER (WHERE response_text IS NOT NULL)
               AS answers, arg_min(template, trace_id) AS template
      FROM t WHERE signature IN (SELECT signature FROM keep) GROUP BY step, signature)
SELECT r.step, r.signature, d.text, {", ".join("r." + c for c in _SUMMED)},
       r.calls, r.errors, r.example, d.prompts, d.answers, d.template, {", ".join(_TOTALS)},
       r.s_calls
FROM r JOIN d USING (step, signature)
"""
# Validation passes (validate=True) over the prompts that every pass has: the same data,
# pass after pass (tracer/readers/habits/independent.py compares them with training reward).
_VALIDATION = """
WITH v AS (
  SELECT CAST(step AS BIGINT) AS step, coalesce(prompt, sample_key) AS prompt, reward
  FROM (SELECT step, prompt, sample_key, {reward} AS reward FROM src
        WHERE coalesce(validate, false) AND step IS NOT NULL
          AND NOT isnan(CAST(step AS DOUBLE)))),
common AS (SELECT prompt FROM v WHERE prompt IS NOT NULL GROUP BY prompt
           HAVING count(DISTINCT step) = (SELECT count(DISTINCT step) FROM v))
SELECT step, count(reward), coalesce(sum(reward), 0), coalesce(sum(reward * reward), 0) FROM v
WHERE prompt IN (SELECT prompt FROM common) GROUP BY step
"""


def _source(con: Any, source: Any) -> set[str]:
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "trajectories.parquet")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no trajectories table (an export folder holds "
                                    "trajectories.parquet)")  # fmt: skip
        quoted = path.replace("'", "''")
        con.execute(f"CREATE TEMP VIEW src AS SELECT * FROM read_parquet('{quoted}')")
    elif hasattr(source, "column_names"):  # an Arrow table, read in place
        con.register("src", source.select([c for c in COLUMNS if c in source.column_names]))
    else:  # a pandas DataFrame (only the columns needed: others may hold numpy arrays)
        con.register("src", _from_pandas(source))
    names = {row[0] for row in con.execute("DESCRIBE SELECT * FROM src").fetchall()}
    if "signature" not in names:
        raise NoSignatures("the trajectories table has no signature column (exported before "
                           "behaviour signatures existed): export the run again")  # fmt: skip
    return names


def _from_pandas(df: Any) -> Any:
    """The columns needed as an Arrow table: ``reward_parts`` (pairs, in pandas) as a map."""
    import pyarrow as pa

    from tracer.readers.habits.earned import parts_of

    plain = pa.Table.from_pandas(df[[c for c in COLUMNS if c in df.columns and
                                     c != "reward_parts"]], preserve_index=False)  # fmt: skip
    if "reward_parts" not in df.columns:
        return plain
    parts = pa.array([parts_of(v) or None for v in df["reward_parts"]],
                     type=pa.map_(pa.string(), pa.float64()))  # fmt: skip
    return plain.append_column("reward_parts", parts)


Grouped = tuple[list["Group"], dict[int, "StepTotal"]]


def connect(source: Any, earned_by: str | None = None, running: set[Any] | None = None) -> Any:
    """A DuckDB connection with the view ``t`` over ``source`` (a folder, a Parquet file, a
    DataFrame, an Arrow table)."""
    import duckdb

    con = duckdb.connect()
    if running is not None:
        # query_progress() answers -1 unless the progress bar is on (printing nothing)
        con.execute("SET enable_progress_bar = true; SET enable_progress_bar_print = false")
        running.add(con)
    try:
        con.execute(_rows(_source(con, source), earned_by))
    except BaseException:
        if running is not None:
            running.discard(con)
        con.close()
        raise
    return con


def duckdb_groups(source: Any, top: int, min_count: int, running: set[Any] | None = None,
                  earned_by: str | None = None) -> Grouped:  # fmt: skip
    """Groups and step totals of ``source`` with DuckDB. The connection sits in ``running``
    meanwhile, so that another thread can read its ``query_progress()`` or ``interrupt()``
    it."""
    con = connect(source, earned_by, running)
    try:
        totals: dict[int, StepTotal] = {}
        groups = []
        k = len(_SUMMED)
        for row in con.execute(_GROUPS, {"top": top, "min_count": min_count}).fetchall():
            step, signature, text = row[:3]
            sums = dict(zip(_SUMMED, row[3 : 3 + k], strict=True))
            calls, errors, example, prompts, answers, template = row[3 + k : 9 + k]
            groups.append(Group(int(step), signature, text or "", int(calls), int(errors),
                                example, int(prompts), int(answers), template or "",
                                **_counts(sums)))  # fmt: skip
            if int(step) not in totals:  # every step has its top signatures here
                totals[int(step)] = StepTotal(
                    int(step), int(row[-1] or 0),
                    **_counts(dict(zip(_SUMMED, row[9 + k : -1], strict=True)))
                )  # fmt: skip
        _near_dups(con, groups, totals, min_count)
        _validation(con, totals)
        return groups, totals
    finally:
        if running is not None:
            running.discard(con)
        con.close()


_SAMPLES = """
SELECT step, signature, prompt, response_text FROM (
  SELECT step, signature, prompt, response_text,
         row_number() OVER (PARTITION BY step, signature ORDER BY trace_id) AS i
  FROM t WHERE (step, signature) IN (SELECT unnest($steps), unnest($sigs)))
WHERE i <= $sample
"""


def needs_near_dups(g: Group, total: StepTotal, min_count: int) -> bool:
    """A group large enough to be flagged, without correctness, paid above its step's mean:
    the groups whose ``repeated`` (the evidence a run without a correctness signal has) can
    decide anything."""
    mean, step_mean = g.reward_mean, total.reward_mean
    return (g.n >= min_count and g.n_checked < g.n / 2 and mean is not None
            and step_mean is not None and mean > step_mean)  # fmt: skip


def _near_dups(con: Any, groups: list[Group], totals: dict[int, StepTotal],
               min_count: int) -> None:  # fmt: skip
    """``repeated`` of the groups that need it, over a sample of their answers."""
    from tracer.readers.habits.near_dup import SAMPLE, repeated_share

    wanted = {(g.step, g.signature): g for g in groups
              if needs_near_dups(g, totals[g.step], min_count)}  # fmt: skip
    if not wanted:
        return
    steps, sigs = zip(*wanted, strict=True)
    answers: dict[tuple[int, str], list[tuple[Any, str | None]]] = {}
    for step, sig, prompt, text in con.execute(
        _SAMPLES, {"steps": list(steps), "sigs": list(sigs), "sample": SAMPLE}
    ).fetchall():
        answers.setdefault((int(step), sig), []).append((prompt, text))
    for key, g in wanted.items():
        g.repeated = repeated_share(answers.get(key, []))


def _validation(con: Any, totals: dict[int, StepTotal]) -> None:
    """Each validation pass's ``val_n`` and ``val_sum`` (a step of validation only gets a
    total of its own, with ``n`` 0)."""
    names = {row[0] for row in con.execute("DESCRIBE SELECT * FROM src").fetchall()}
    if "validate" not in names:
        return
    query = _VALIDATION.format(reward=_double("reward"))
    for step, n, total, sq in con.execute(query).fetchall():
        t = totals.setdefault(int(step), StepTotal(int(step)))
        t.val_n, t.val_sum, t.val_sq = int(n), float(total), float(sq)


def _counts(sums: dict[str, Any]) -> dict[str, Any]:
    return {k: (float(v) if k.endswith("_sum") or k.endswith("_sq") else int(v))
            for k, v in sums.items()}  # fmt: skip


def check_export_part(source: Any, earned_by: str | None) -> None:
    """:func:`~tracer.readers.habits.earned.check_part` over an export (a folder, a Parquet
    file, a DataFrame, an Arrow table), in DuckDB: raises ``UnknownPart``."""
    if earned_by is None:
        return
    import duckdb

    from tracer.readers.habits.earned import check_part

    con = duckdb.connect()
    try:
        names = _source(con, source)
        parts: set[str] = set()
        if "reward_parts" in names:
            parts = {str(r[0]) for r in con.execute(
                "SELECT DISTINCT unnest(map_keys(reward_parts)) FROM src").fetchall()}  # fmt: skip
        counted = con.execute(f"SELECT count({_double('accuracy')}) FROM src").fetchone() if (
            "accuracy" in names) else None  # fmt: skip
        has_accuracy = bool(counted and counted[0])
    finally:
        con.close()
    check_part(earned_by, parts, has_accuracy)
