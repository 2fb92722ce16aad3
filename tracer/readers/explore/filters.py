"""Query-string filters -> a parameterised SQL ``WHERE`` clause over the trajectories table.

Nothing the user sends is pasted into SQL: column names come from a whitelist (the export
schema), operators from a fixed table, and every value travels as a bound parameter. Anything
else is an :class:`ApiError` that names what was wrong and what is valid.

    step=3:7            step range (inclusive; either side may be empty: ``step=5:``)
    reward=0:0.5        reward range
    validate=true       validation rollouts only (``false``: training only)
    finish_reason=length,stop     one of these values (also worker_id, kept_by, policy_version,
                                  status, sample_key, experiment_name, name, trace_id,
                                  signature: a behaviour signature, 16 hex characters)
    flag=truncated      has this health flag
    tool_errors=true    at least one tool error (``false``: none)
    f=latency_ms>2000   any column: =, !=, <, <=, >, >=, ~ (contains, case-insensitive)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from tracer.readers.schema import TRAJECTORIES

MAX_VALUE_CHARS = 1000
MAX_FILTERS = 32
INT64 = 2**63 - 1


class ApiError(ValueError):
    """A bad request: ``status`` 400 (or 404), ``message`` says what to change."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


TYPES: dict[str, str] = {name: kind for name, kind, _ in TRAJECTORIES}
# columns a filter or a sort may name (list columns have their own filter: ``flag``)
SCALAR = {name for name, kind in TYPES.items() if not kind.startswith("list")}
LIST_PARAMS = ("finish_reason", "worker_id", "kept_by", "policy_version", "status",
               "sample_key", "experiment_name", "name", "trace_id", "signature",
               "behaviour")  # fmt: skip
_SIGNATURE = re.compile(r"[0-9a-f]{16}")
RANGE_PARAMS = ("step", "reward")
OPS = {"=": "=", "!=": "<>", "<": "<", "<=": "<=", ">": ">", ">=": ">="}
_F = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(!=|<=|>=|=|<|>|~)\s*(.*)$", re.S)


@dataclass
class Where:
    """A WHERE clause (``sql``, without the keyword) and its bound ``params``, in order."""

    parts: list[str] = field(default_factory=list)
    params: list[Any] = field(default_factory=list)

    @property
    def sql(self) -> str:
        return " AND ".join(self.parts) if self.parts else "TRUE"

    def add(self, sql: str, *params: Any) -> None:
        self.parts.append(sql)
        self.params.extend(params)


def _text(value: str, name: str) -> str:
    if len(value) > MAX_VALUE_CHARS:
        raise ApiError(f"{name}: value longer than {MAX_VALUE_CHARS} characters")
    return value


def convert(column: str, raw: str) -> Any:
    """``raw`` as a value of ``column``'s type, or an ApiError saying why it is not one."""
    _text(raw, column)
    kind = TYPES[column]
    try:
        if kind == "int64":
            value: Any = int(raw)
            if abs(value) > INT64:
                raise ApiError(f"{column}: {raw!r} is out of the int64 range")
            return value
        if kind == "float64":
            value = float(raw)
            if not math.isfinite(value):
                raise ApiError(f"{column}: {raw!r} is not a finite number")
            return value
    except ValueError as exc:
        if isinstance(exc, ApiError):
            raise
        raise ApiError(f"{column}: {raw!r} is not a {'number' if kind == 'float64' else 'whole number'}") from None  # noqa: E501
    if kind == "bool":
        if raw.lower() not in ("true", "false", "1", "0"):
            raise ApiError(f"{column}: {raw!r} is not true or false")
        return raw.lower() in ("true", "1")
    return raw  # strings; timestamps compare as ISO 8601 text cast by DuckDB


def _column(name: str) -> str:
    if name not in SCALAR:
        raise ApiError(f"unknown column {name!r}; valid: {', '.join(sorted(SCALAR))}")
    return f'"{name}"'  # whitelisted, so quoting is only for reserved words


def _range(w: Where, column: str, raw: str) -> None:
    if ":" not in raw:
        w.add(f"{_column(column)} = ?", convert(column, raw))
        return
    lo, hi = raw.split(":", 1)
    if lo.strip():
        w.add(f"{_column(column)} >= ?", convert(column, lo.strip()))
    if hi.strip():
        w.add(f"{_column(column)} <= ?", convert(column, hi.strip()))


def _generic(w: Where, expr: str) -> None:
    m = _F.match(_text(expr, "f"))
    if not m:
        raise ApiError(f"f: {expr!r} is not COLUMN OP VALUE (OP one of = != < <= > >= ~)")
    name, op, raw = m.group(1), m.group(2), m.group(3).strip()
    col = _column(name)
    if op == "~":
        w.add(f"CAST({col} AS VARCHAR) ILIKE ? ESCAPE '\\'", like_pattern(raw))
    elif raw.lower() == "null" and op in ("=", "!="):
        w.add(f"{col} IS {'' if op == '=' else 'NOT '}NULL")
    else:
        value = convert(name, raw)
        cast = "CAST(? AS TIMESTAMPTZ)" if TYPES[name].startswith("timestamp") else "?"
        w.add(f"{col} {OPS[op]} {cast}", value)


def like_pattern(text: str) -> str:
    """An ``ILIKE ? ESCAPE '\\'`` pattern: ``text`` anywhere, its ``%`` and ``_`` literal."""
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def _bool(name: str, raw: str) -> bool:
    if raw.lower() not in ("true", "false", "1", "0"):
        raise ApiError(f"{name}: {raw!r} is not true or false")
    return raw.lower() in ("true", "1")


FILTER_PARAMS = (*RANGE_PARAMS, "validate", *LIST_PARAMS, "flag", "tool_errors", "f")


def parse_filters(query: dict[str, list[str]]) -> Where:
    """The WHERE clause of the filter parameters in ``query`` (others are ignored here)."""
    w = Where()
    count = sum(len(query.get(k, [])) for k in FILTER_PARAMS)
    if count > MAX_FILTERS:
        raise ApiError(f"too many filters ({count}; at most {MAX_FILTERS})")
    for name in RANGE_PARAMS:
        for raw in query.get(name, []):
            _range(w, name, raw)
    for raw in query.get("validate", []):
        w.add('"validate" = ?', _bool("validate", raw))
    for name in LIST_PARAMS:
        for raw in query.get(name, []):
            values = [v for v in _text(raw, name).split(",") if v]
            bad = [v for v in values if name == "signature" and not _SIGNATURE.fullmatch(v)]
            if bad:
                raise ApiError(f"signature: {bad[0][:40]!r} is not a behaviour signature (16 "
                               "hex characters, as /api/patterns gives them)")  # fmt: skip
            if values:
                w.add(f'"{name}" IN ({", ".join("?" * len(values))})', *values)
    for raw in query.get("flag", []):
        w.add("list_contains(flags, ?)", _text(raw, "flag"))
    for raw in query.get("tool_errors", []):
        w.add("num_tool_errors > 0" if _bool("tool_errors", raw) else "num_tool_errors = 0")
    for raw in query.get("f", []):
        _generic(w, raw)
    return w


def parse_sort(raw: str | None, tiebreak: str = "trace_id") -> str:
    """``reward`` / ``-reward`` (descending) -> an ORDER BY clause, ``tiebreak`` (a unique
    column) breaking ties so pages never overlap."""
    if not raw:
        return f"step, sample_index, rollout_n, {tiebreak}"
    desc = raw.startswith("-")
    col = _column(raw.lstrip("-+"))
    return f"{col} {'DESC' if desc else 'ASC'} NULLS LAST, {tiebreak}"


def parse_columns(raw: str | None, default: list[str]) -> list[str]:
    if not raw:
        return default
    names = [c for c in raw.split(",") if c]
    for name in names:
        if name not in TYPES:
            raise ApiError(f"unknown column {name!r}; valid: {', '.join(TYPES)}")
    return list(dict.fromkeys(["trace_id", *names]))


def parse_int(query: dict[str, list[str]], name: str, default: int, lo: int, hi: int) -> int:
    values = query.get(name)
    raw = values[-1] if values else ""
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(f"{name}: {raw[:50]!r} is not a whole number") from None
    if not lo <= value <= hi:
        raise ApiError(f"{name}: {value} is out of range [{lo}, {hi}]")
    return value
