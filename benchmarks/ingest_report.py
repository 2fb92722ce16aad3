"""The ingest benchmark's section of RESULTS.md (benchmarks/ingest.py's ``render``): the
curve and runs table, the held rate's verdict, the fault run."""

from __future__ import annotations

from typing import Any

from benchmarks.ingest_held import is_held

TARGETS = (68, 550, 1100)  # traces/s: 64 nodes; 512 nodes at 50 % and 100 % sampling


def _expected(run: dict[str, Any]) -> int:
    """What the store should hold after a run: its trajectories and each writer's warm-up."""
    return int(run["total"]) + int(run.get("warmup", 0))


def render(r: dict[str, Any]) -> str:
    """The section of RESULTS.md."""
    lines = ["## 8. Ingest capacity: PostgreSQL-backed MLflow, many writers", ""]
    if "skipped" in r:
        return "\n".join([*lines, f"skipped: {r['skipped']}", ""])
    m = r.get("machine", {})
    lines += [f"Traces of 20 spans per second, all writers together (each writer its own process; "
              f"checked against the store with MLflow's client); load average at the start "
              f"{m.get('load_avg')}, {m.get('cores')} cores"
              f"{', writers pinned to CPU 0 and PostgreSQL to CPU 1' if r.get('pin') else ''}. "
              f"Needed: {TARGETS[0]} traces/s at 64 nodes, {TARGETS[1]}-{TARGETS[2]} at 512.", "",
              "| path | writers | traces/s | stored | CPU-s per 1,000 traces: writers | "
              f"PostgreSQL | server{' or PgBouncer' if r.get('pgbouncer') else ''} |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    rows = [(k.split("/")[0], v) for k, v in r["curve"].items()]
    rows += [(f"bulk, {k}", v) for k, v in r["runs"].items()]
    for path, s in rows:
        lines.append(f"| {path} | {s['writers']} | {s['traces_per_s']} ({s['wall_s']} s) | "
                     f"{s['stored']}/{_expected(s)} | {s['writer_cpu_s_per_1k']} | "
                     f"{s.get('pg_cpu_s_per_1k', '-')} | "
                     f"{s.get('server_cpu_s_per_1k', '-')} |")  # fmt: skip
    for key in ("sustain", "held"):
        held = r["runs"].get(key, {})
        if not held.get("offered_per_s"):
            continue
        lag = held.get("lag_s") or {}
        verdict = "held" if is_held(held) else "not held"
        lines += ["", f"Held rate ({key}): {held['offered_per_s']} traces/s offered, "
                  f"{held['made_per_s']} made, {held['traces_per_s']} durable over the run "
                  f"({held['stored']} of {_expected(held)} stored); the last durable "
                  f"{held['drain_s']} s after the last made; the store's lag behind the "
                  f"rollout while it ran: median {lag.get('p50')} s, largest {lag.get('max')} "
                  f"s, largest by tenth of the run {lag.get('max_by_tenth')}: the rate was "
                  f"**{verdict}**; CPU-s per 1,000 traces: writers "
                  f"{held['writer_cpu_s_per_1k']} (the rollout processes' own "
                  f"{held.get('rollout_cpu_s_per_1k')}, the rest their export children's), "
                  f"PostgreSQL {held.get('pg_cpu_s_per_1k')}."]  # fmt: skip
    if "fault" in r["runs"]:
        f = r["runs"]["fault"]
        done = ("restarted once" if f.get("restarted")
                else "NOT restarted (the writers were done first)")  # fmt: skip
        lines += ["", f"Fault run: PostgreSQL {done} (`pg_ctl restart -m fast`); stored "
                  f"{f['stored']} of {_expected(f)}; 'is down' lines per writer {f['down_lines']}, "
                  f"'is back' lines {f['back_lines']} (none when every batch got through "
                  f"within its retries: a quick restart is absorbed)."]  # fmt: skip
    lines += ["", f"Writer processes left behind: {len(r['left_behind'])}."]
    return "\n".join(lines) + "\n"
