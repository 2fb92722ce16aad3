"""False positives and cost of the built-in redaction rules on the project's own text (#55).

The corpus holds no secret, so every string a rule changes is a false positive: the rollout's
data (rollout/data/*.jsonl: math problems, solutions, the retrieval corpus), every paragraph of
README.md and docs/*.md, and one SHA-1 hex digest per corpus string (what git commit ids and
checksums look like). The bare 40-hex W&B rule the tracer used before #55 is counted beside
the rules of today. Cost: process CPU time of ``Redactor.value`` on a trajectory-shaped record
(4 chat messages and a tool call from the corpus), per trajectory.

    python -m benchmarks.bench_redact                 # print
    python -m benchmarks.bench_redact --record        # also record the figures
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

from tracer.redact import BUILTIN_PATTERNS, Redactor

ROOT = Path(__file__).resolve().parent.parent
OLD_WANDB_RULE = re.compile(r"(?<![0-9a-f])[0-9a-f]{40}(?![0-9a-f])")  # before #55


def corpus() -> dict[str, list[str]]:
    data = [v for path in sorted((ROOT / "rollout" / "data").glob("*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()
            for v in json.loads(line).values() if isinstance(v, str)]  # fmt: skip
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    docs = [p for page in pages for p in page.read_text().split("\n\n") if p.strip()]
    shas = [f"commit {hashlib.sha1(s.encode()).hexdigest()}" for s in data + docs]
    return {"rollout data": data, "docs": docs, "hex digests": shas}


def false_positives(texts: dict[str, list[str]]) -> dict[str, int]:
    """Strings each rule changes (a corpus without secrets: all of them are false)."""
    counts = {name: 0 for name in BUILTIN_PATTERNS}
    counts["wandb-key (bare 40 hex, before #55)"] = 0
    rules = {name: re.compile(rx) for name, (_, rx) in BUILTIN_PATTERNS.items()}
    for strings in texts.values():
        for s in strings:
            for name, rx in rules.items():
                counts[name] += bool(rx.search(s))
            counts["wandb-key (bare 40 hex, before #55)"] += bool(OLD_WANDB_RULE.search(s))
    return counts


def trajectories(texts: dict[str, list[str]], n: int) -> list[dict[str, Any]]:
    flat = [s for strings in texts.values() for s in strings]
    out = []
    for i in range(n):
        pick = [flat[(i * 7 + k) % len(flat)] for k in range(6)]
        out.append({
            "messages": [{"role": "system", "content": pick[0]},
                         {"role": "user", "content": pick[1]},
                         {"role": "assistant", "content": pick[2]},
                         {"role": "tool", "content": pick[3]}],
            "tool_call": {"name": "search", "arguments": {"query": pick[4]}},
            "response": pick[5],
            "reward": 1.0,
        })  # fmt: skip
    return out


def cost_us(texts: dict[str, list[str]], n: int) -> float:
    """Process CPU microseconds of the built-in rules per trajectory."""
    redactor = Redactor([])
    records = trajectories(texts, n)
    start = time.process_time()
    for record in records:
        redactor.value(record)
    return (time.process_time() - start) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="trajectories timed")
    parser.add_argument("--record", action="store_true", help="record into figures.json")
    args = parser.parse_args(argv)
    texts = corpus()
    total = sum(len(v) for v in texts.values())
    counts = false_positives(texts)
    print(f"corpus: {total} strings ({', '.join(f'{k} {len(v)}' for k, v in texts.items())})")
    for name, count in counts.items():
        print(f"  {name:40s} {count} false positives")
    us = cost_us(texts, args.n)
    print(f"redaction cost: {us:.1f} us of process CPU per trajectory ({args.n} trajectories)")
    if args.record:
        from benchmarks import figures

        now = sum(c for k, c in counts.items() if "before" not in k)
        old = counts["wandb-key (bare 40 hex, before #55)"]
        command = "python -m benchmarks.bench_redact --record"
        figures.record("redact-false-positives",
                       f"{now} of {total} strings redacted (the bare 40-hex rule before: {old})",
                       figure="redaction's false positives on the project's own text and "
                              "hex digests", command=command)  # fmt: skip
        figures.record("redact-cost", f"{us:.0f} µs per trajectory",
                       figure="built-in redaction, process CPU per trajectory of corpus text",
                       command=command)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
