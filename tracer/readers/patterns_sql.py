"""The grouping behind :mod:`tracer.readers.patterns`, in DuckDB: one scan of the
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


class NoSignatures(ValueError):
    """The table has no ``signature`` column: an export written before signatures existed."""


@dataclass(kw_only=True)
class Counts:
    """Trajectories counted, with the sums their reward and length means come from."""

    n: int = 0
    n_reward: int = 0  # trajectories with a reward
    reward_sum: float = 0.0
    reward_sq: float = 0.0
    n_len: int = 0  # trajectories with a length
    len_sum: float = 0.0

    def add(self, reward: float | None, length: float | None) -> None:
        self.n += 1
        if reward is not None:
            self.n_reward += 1
            self.reward_sum += reward
            self.reward_sq += reward * reward
        if length is not None:
            self.n_len += 1
            self.len_sum += length

    def merge(self, other: Counts) -> None:
        self.n += other.n
        self.n_reward += other.n_reward
        self.reward_sum += other.reward_sum
        self.reward_sq += other.reward_sq
        self.n_len += other.n_len
        self.len_sum += other.len_sum

    @property
    def reward_mean(self) -> float | None:
        return self.reward_sum / self.n_reward if self.n_reward else None

    @property
    def reward_std(self) -> float | None:
        mean = self.reward_mean
        if mean is None:
            return None
        return max(self.reward_sq / self.n_reward - mean * mean, 0.0) ** 0.5


@dataclass
class StepTotal(Counts):
    """All training trajectories of one step."""

    step: int


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


COLUMNS = ("trace_id", "step", "validate", "signature", "signature_text", "reward",
           "response_tokens", "response_text", "num_tool_calls", "num_tool_errors", "prompt",
           "sample_key")  # fmt: skip


def _double(column: str) -> str:
    # pandas keeps a missing number as NaN, which DuckDB would average as a number
    return (f"(CASE WHEN isnan(CAST({column} AS DOUBLE)) THEN NULL "
            f"ELSE CAST({column} AS DOUBLE) END)")  # fmt: skip


_ROWS = f"""
CREATE TEMP VIEW t AS
SELECT trace_id, CAST(step AS BIGINT) AS step, signature, signature_text,
       {_double("reward")} AS reward,
       coalesce({_double("response_tokens")}, CAST(length(response_text) AS DOUBLE)) AS len,
       coalesce({_double("num_tool_calls")}, 0) AS calls,
       coalesce({_double("num_tool_errors")}, 0) AS errors,
       coalesce(prompt, sample_key) AS prompt, response_text
FROM src
WHERE step IS NOT NULL AND NOT isnan(CAST(step AS DOUBLE)) AND NOT coalesce(validate, false)
  AND signature IS NOT NULL
"""
_SUMS = ("count(*) AS n, count(reward) AS n_reward, coalesce(sum(reward), 0) AS reward_sum, "
         "coalesce(sum(reward * reward), 0) AS reward_sq, count(len) AS n_len, "
         "coalesce(sum(len), 0) AS len_sum")  # fmt: skip
_TOTALS = ("s_n", "s_n_reward", "s_reward_sum", "s_reward_sq", "s_n_len", "s_len_sum")
# One scan groups every trajectory by (step, signature), with the step's totals alongside; a
# second reads only the rows of the signatures kept, for their distinct prompts and responses
# (64-bit hashes: cheaper than the texts) and their text.
_GROUPS = f"""
WITH g AS (
  SELECT step, signature, {_SUMS}, sum(calls) AS calls, sum(errors) AS errors,
         min(trace_id) AS example
  FROM t GROUP BY step, signature),
r AS (SELECT *, row_number() OVER (PARTITION BY step ORDER BY n DESC, signature) AS rank,
             {", ".join(f"sum({c[2:]}) OVER w AS {c}" for c in _TOTALS)}
      FROM g WINDOW w AS (PARTITION BY step)),
keep AS (SELECT signature FROM r GROUP BY signature HAVING min(rank) <= $top
         OR max(n) >= $min_count),
d AS (SELECT step, signature, min(signature_text) AS text,
             count(DISTINCT hash(prompt)) AS prompts,
             count(DISTINCT hash(response_text)) AS answers
      FROM t WHERE signature IN (SELECT signature FROM keep) GROUP BY step, signature)
SELECT r.step, r.signature, d.text, r.n, r.n_reward, r.reward_sum, r.reward_sq, r.n_len,
       r.len_sum, r.calls, r.errors, r.example, d.prompts, d.answers, {", ".join(_TOTALS)}
FROM r JOIN d USING (step, signature)
"""


def _source(con: Any, source: Any) -> None:
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
        con.register("src", source[[c for c in COLUMNS if c in source.columns]])
    names = {row[0] for row in con.execute("DESCRIBE SELECT * FROM src").fetchall()}
    if "signature" not in names:
        raise NoSignatures("the trajectories table has no signature column (exported before "
                           "behaviour signatures existed): export the run again")  # fmt: skip


Grouped = tuple[list["Group"], dict[int, "StepTotal"]]


def duckdb_groups(source: Any, top: int, min_count: int,
                  running: set[Any] | None = None) -> Grouped:  # fmt: skip
    """Groups and step totals of ``source`` (a folder, a Parquet file, a DataFrame, an Arrow
    table) with DuckDB. The connection sits in ``running`` meanwhile, so that another thread
    can read its ``query_progress()`` or ``interrupt()`` it."""
    import duckdb

    con = duckdb.connect()
    if running is not None:
        # query_progress() answers -1 unless the progress bar is on (printing nothing)
        con.execute("SET enable_progress_bar = true; SET enable_progress_bar_print = false")
        running.add(con)
    try:
        _source(con, source)
        con.execute(_ROWS)
        totals: dict[int, StepTotal] = {}
        groups = []
        for row in con.execute(_GROUPS, {"top": top, "min_count": min_count}).fetchall():
            step, signature, text, *sums = row[:9]
            calls, errors, example, prompts, answers = row[9:14]
            groups.append(Group(int(step), signature, text or "", int(calls), int(errors),
                                example, int(prompts), int(answers), **_counts(sums)))  # fmt: skip
            if int(step) not in totals:  # every step has its top signatures here
                totals[int(step)] = StepTotal(int(step), **_counts(list(row[14:])))
        return groups, totals
    finally:
        if running is not None:
            running.discard(con)
        con.close()


def _counts(sums: list[Any]) -> dict[str, Any]:
    n, n_reward, reward_sum, reward_sq, n_len, len_sum = sums
    return {"n": int(n), "n_reward": int(n_reward), "reward_sum": float(reward_sum),
            "reward_sq": float(reward_sq), "n_len": int(n_len),
            "len_sum": float(len_sum)}  # fmt: skip
