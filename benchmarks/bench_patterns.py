"""What behaviour grouping and flags add to an export, and what the pattern query costs.

    python -m benchmarks.bench_patterns --n 20000 [--pairs 2] [--patterns-n 200000]

1. Export time with and without signatures: ``--n`` agent-loop trajectories (3 generate calls
   with ~430-character responses and ``--ids`` token ids each, 3 tool calls, 3 % of them
   failing, a reward span that scored the final answer) written as JSONL by the tracer's own
   writer, then exported to Parquet (``tracer.readers.export``) ``--pairs`` times each way,
   interleaved (without, with, ...); the added share is that of the median CPU time (all
   threads of the process: steadier than wall time on a shared machine). "Without" replaces
   the signature, behaviour and reward-parts functions by constants. Then the flags:
   ``step_patterns`` (grouping by behaviour, the rules, the evidence pairs) over the "with"
   export, median of 3 (CPU time); ``added_pct`` is (with - without + flags) / without. Also
   the signatures alone (CPU time), over the same records.
2. ``step_patterns`` over the Parquet of ``--patterns-n`` trajectories of
   ``benchmarks/explore_data.py --scenario hacking`` (80 steps), median of 3.

:func:`explorer_tab` is the explorer's Patterns tab, timed by ``python -m benchmarks.explore``
(``--scenario hacking`` mixes the hack into its data).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi")
         for b in ("ba", "de", "fi", "go", "hu", "ja", "ko", "le")]  # fmt: skip


def _text(rng: random.Random, chars: int = 430) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS) if rng.random() > 0.1 else str(rng.randint(2, 999)))
    return " ".join(words).capitalize() + "."


def records(n: int, ids: int = 110, seed: int = 0) -> list[Any]:
    import tracer

    rng = random.Random(seed)
    out = []
    for i in range(n):
        t0 = 1_700_000_000_000_000_000 + i * 10_000_000
        root = f"{i:08x}00000000"
        spans = [tracer.SpanRecord(root, None, "agent_loop", "trajectory", t0, t0 + 9_000_000)]
        final = ""
        for turn in range(3):
            base = t0 + 1 + turn * 2_000_000
            tail = ' <tool_call>{"name": "calculator"}</tool_call>'
            if turn == 2:
                tail = f" The answer is #### {rng.randint(1, 9999)}."
            final = _text(rng) + tail
            spans.append(tracer.SpanRecord(
                f"{i:08x}{turn:04x}0001", root, "generate", "generate", base, base + 900_000,
                inputs={"prompt_ids": list(range(40))},
                outputs={"response_ids": list(range(ids)), "finish_reason": "stop"} if ids
                else {"finish_reason": "stop"},
                attributes={"prompt_text": "q", "response_text": final + "<|im_end|>",
                            "prompt_tokens": 40, "response_tokens": 110,
                            "finish_reason": "stop"}))  # fmt: skip
            name = rng.choice(("calculator", "search", "python"))
            failed = rng.random() < 0.03
            spans.append(tracer.SpanRecord(
                f"{i:08x}{turn:04x}0002", root, name, "tool", base + 1_000_000,
                base + 1_500_000, status="ERROR" if failed else "OK",
                error={"type": "TimeoutError", "message": "timeout"} if failed else None,
                inputs={"name": name, "arguments": {"expression": f"{turn} * {i}"}},
                outputs=None if failed else {"content": str(turn * i)},
                attributes={"tool_name": name}))  # fmt: skip
        spans.append(tracer.SpanRecord(
            f"{i:08x}00000009", root, "reward", "reward", t0 + 8_000_000, t0 + 8_100_000,
            inputs={"final_text": final, "ground_truth": "42"},
            outputs={"score": 1.0, "accuracy": 1.0}))  # fmt: skip
        out.append(tracer.TrajectoryRecord(
            trace_id=f"{i:032x}", name="agent_loop", project_name="bench",
            experiment_name="grpo", step=i // 256 + 1, sample_index=i % 256 // 4,
            rollout_n=i % 4, validate=False, worker_id="w0", start_ns=t0,
            end_ns=t0 + 9_000_000, reward=rng.random(), spans=spans))  # fmt: skip
    return out


def _export(path: str, out: str) -> tuple[float, float]:
    """(wall s, CPU s of this process, all threads) of one export."""
    from tracer.readers import export

    t0, c0 = time.perf_counter(), time.process_time()
    export("jsonl", out, path=path)
    return time.perf_counter() - t0, time.process_time() - c0


def bench_export(n: int, pairs: int, tmp: Path, ids: int) -> dict[str, Any]:
    import tracer
    import tracer.readers.rows as rows
    from tracer.backends.jsonl_backend import JsonlExporter
    from tracer.readers.habits.patterns import step_patterns
    from tracer.readers.habits.signature import Signature, scored_text, signature

    made = records(n, ids)
    path = str(tmp / "t.jsonl")
    writer = JsonlExporter(tracer.TraceConfig(backend="jsonl", jsonl_path=path))
    for i in range(0, n, 2000):
        writer.export(made[i : i + 2000])
    writer.shutdown()
    t0 = time.process_time()
    for r in made:  # the signature's own work, as rows.py calls it
        calls = [(s.name, s.status == "ERROR") for s in r.spans if s.kind == "tool"]
        last = r.spans[-3].attributes["response_text"]
        signature(calls, "stop", scored_text(r.spans[-1].inputs), last)
    alone = time.process_time() - t0
    del made
    real = (rows.signature, rows.behaviour, rows._reward_parts)
    const = Signature("0" * 16, "")
    fakes = (lambda *a, **k: const, lambda *a, **k: "", lambda *a, **k: None)
    times: dict[str, list[tuple[float, float]]] = {"without": [], "with": []}
    for k in range(pairs):
        for mode in ("without", "with"):
            rows.signature, rows.behaviour, rows._reward_parts = (  # type: ignore[assignment]
                real if mode == "with" else fakes)
            try:
                times[mode].append(_export(path, str(tmp / f"out-{mode}-{k}")))
            finally:
                rows.signature, rows.behaviour, rows._reward_parts = real
    flags = []
    for _ in range(3):
        c0 = time.process_time()
        step_patterns(str(tmp / f"out-with-{pairs - 1}"))
        flags.append(time.process_time() - c0)
    cpu = {mode: [c for _, c in runs] for mode, runs in times.items()}
    without, with_ = statistics.median(cpu["without"]), statistics.median(cpu["with"])
    flag_s = statistics.median(flags)
    return {"n": n, "ids_per_turn": ids,
            "wall_s": {m: [round(w, 2) for w, _ in runs] for m, runs in times.items()},
            "cpu_s": {m: [round(c, 2) for c in v] for m, v in cpu.items()},
            "flags_cpu_s": [round(c, 2) for c in flags],
            "columns_added_pct": round(100 * (with_ - without) / without, 1),
            "added_pct": round(100 * (with_ - without + flag_s) / without, 1),
            "signatures_alone_s": round(alone, 2),
            "signature_us": round(1e6 * alone / n, 1),
            "export_us": round(1e6 * with_ / n, 1)}  # fmt: skip


def bench_patterns(n: int, tmp: Path) -> dict[str, Any]:
    from benchmarks.explore_data import generate
    from tracer.readers.habits.patterns import step_patterns

    folder = tmp / "hack"
    generate(str(folder), n, steps=80, scenario="hacking")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        found = step_patterns(str(folder))
        times.append(time.perf_counter() - t0)
    return {"n": n, "step_patterns_s": [round(t, 3) for t in times], "summary": found.summary(),
            "flagged": [(r.text[:60], r.first_step, r.hacking_step)
                        for r in found.rising]}  # fmt: skip


def explorer_tab(data: str, cache: str, steps: int, lines: list[str]) -> None:
    """The Patterns tab over HTTP (``rollout-tracer explore`` in its own process): the table's
    computation (once per export, after the compacted copy; read from the cache folder when an
    earlier part of the benchmark made it), then ``/api/patterns`` at 30 random steps and the
    list of the top pattern's trajectories."""
    import glob
    import json
    import random

    from benchmarks.explorer_http import get as _get
    from benchmarks.explorer_http import percentile as _p
    from benchmarks.explorer_http import start

    rng = random.Random(3)
    t0 = time.perf_counter()
    proc, base, _ = start(["--from", "parquet", "--path", data, "--cache-dir", cache,
                           "--no-search"])  # fmt: skip
    try:
        while True:
            state = _get(base, "api/status")[1]["runs"][0]["patterns"]["state"]
            if state in ("ready", "failed"):
                break
            time.sleep(0.2)
        ready = time.perf_counter() - t0
        if state == "failed":
            lines.append(f"| Patterns tab | failed: {_get(base, 'api/status')[1]} |")
            return
        times, bodies = [], []
        for _ in range(30):
            dt, body = _get(base, "api/patterns", [("step", rng.randint(1, steps))])
            times.append(dt)
            bodies.append(body)
        top = bodies[-1]["patterns"][0]
        key = "signature" if len(top["signature"]) == 16 else "behaviour"
        listed = _get(base, "api/list", [(key, top["signature"]),
                                         ("step", f"{bodies[-1]['step']}:{bodies[-1]['step']}"),
                                         ("size", 50)])[0]  # fmt: skip
        rising = bodies[-1]["rising"]
    finally:
        proc.terminate()
        proc.wait(30)
    built = [json.loads(Path(f).read_text()) for f in
             glob.glob(os.path.join(cache, "patterns", "*", "built.json"))]  # fmt: skip
    computed = max((b["computed_s"] for b in built), default=float("nan"))
    flagged = ", ".join(f"{' + '.join(r['labels'])} from step {r['first_step']}"
                        for r in rising[:3]) or "none"  # fmt: skip
    lines += [
        f"| Patterns tab: per-step table computed once per export (one DuckDB scan of the "
        f"compacted copy; cached) | {computed:.1f} s |",
        f"| Patterns tab: start to ready, table cached | {ready:.1f} s |",
        f"| `/api/patterns` at a step: ranked patterns, share curves, rising ones (30) | p50 "
        f"{_p(times, .5) * 1e3:.0f} ms, p95 {_p(times, .95) * 1e3:.0f} ms |",
        f"| a pattern's trajectories at a step (`/api/list?behaviour=`) | "
        f"{listed * 1e3:.0f} ms |",
        f"| rising patterns found | {len(rising)}: {flagged} |",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--patterns-n", type=int, default=200_000)
    ap.add_argument("--ids", type=int, default=110, help="response token ids per turn (0: none, "
                    "so no tokens table: the lightest export, where signatures weigh most)")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        if args.n:
            print(bench_export(args.n, args.pairs, Path(tmp), args.ids), flush=True)
        if args.patterns_n:
            print(bench_patterns(args.patterns_n, Path(tmp)), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
