"""Synthetic trajectories in the export's Parquet schema, for the explorer's tests and benchmark.

    python -m benchmarks.explore_data --out /tmp/explore-1m --n 1000000 --tokens-per-turn 16

Writes ``trajectories``, ``turns`` (3 per trajectory), ``tool_calls`` (3 per trajectory) and,
with ``--tokens-per-turn``, ``tokens``, with the schema of ``tracer/readers/schema.py``: one row
group per page of 500 trajectories, in step order as an export writes them, so memory stays
bounded whatever ``n``. Deterministic: every draw comes from one private ``numpy`` generator
seeded by ``--seed`` (the global random state is never touched).

Text of realistic length by default: each turn's response 60-100 words, a tool call's
arguments a JSON object with a few words (a search query, a calculation, a line of code) and
its result 20-50 words, a prompt of ~35 words: ~1.3 GB of text at a million trajectories.
``--short-text`` keeps responses of ~45 words and one-number tool results (faster to make).

The shape of a GRPO run: ``steps`` steps, each with samples of ``group`` rollouts; prompts come
from a dataset of ``prompts`` questions that recur across steps (so "the same prompt across
steps" has something to show); about 5% of samples are validation rollouts; a few tool calls
fail; some answers are truncated (``finish_reason = length``, flag ``truncated``); some groups
have all-equal rewards (zero variance).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.timing_data import lay_out
from tracer.readers.habits.behaviour import behaviour
from tracer.readers.habits.signature import signature
from tracer.readers.schema import arrow_schema
from tracer.readers.timing.steps_table import write_steps

PAGE = 500
TURNS = 3  # generate calls per trajectory; a tool call follows each
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "po", "da", "fu", "gri", "bel")
TOOLS = ("calculator", "search", "python")
WORKERS = 8
DATASET_SEED = 20260101


@dataclass
class Shape:
    n: int
    steps: int
    group: int = 4
    prompts: int = 0
    tokens_per_turn: int = 0
    experiment: str = "bench"
    scenario: str = ""  # a behaviour scenario of benchmarks/patterns_data.py ("hacking")
    short_text: bool = False

    @property
    def per_step(self) -> int:
        return max(self.group, -(-self.n // self.steps))


def _vocabulary(rng: np.random.Generator, size: int = 2000) -> list[str]:
    words = set()
    while len(words) < size:
        k = int(rng.integers(2, 5))
        words.add("".join(SYLLABLES[int(i)] for i in rng.integers(0, len(SYLLABLES), k)))
    return sorted(words)


def _sentences(rng: np.random.Generator, words: list[str], count: int = 4096) -> list[str]:
    out = []
    for _ in range(count):
        picks = rng.integers(0, len(words), int(rng.integers(10, 14)))  # 10-13 words
        text = " ".join(words[int(i)] for i in picks)
        out.append(text[0].upper() + text[1:] + ".")
    return out


def _hex_ids(rng: np.random.Generator, n: int, nbytes: int) -> list[str]:
    raw = rng.bytes(n * nbytes).hex()
    w = nbytes * 2
    return [raw[i * w : (i + 1) * w] for i in range(n)]


class Generator:
    """One page of trajectories at a time (all tables of a page are made together)."""

    def __init__(self, shape: Shape, seed: int = 0) -> None:
        self.shape = shape
        self.rng = np.random.default_rng(seed)
        self.time_rng = np.random.default_rng([seed, 49])  # the timing's own draws
        # the dataset (words, sentences, questions) is the same whatever the seed, so runs made
        # with different seeds share their prompts, as a run and its baseline do
        dataset = np.random.default_rng(DATASET_SEED)
        words = _vocabulary(dataset)
        self.sentences = np.array(_sentences(dataset, words), dtype=object)
        self.token_vocab = pa.array(words[:512])
        n_prompts = shape.prompts or max(50, shape.n // 40)
        self.questions = [
            f"Question {q}: what is {17 + q % 83} * {23 + q % 61}, and why? "
            + " ".join(self.sentences[(q * 7 + j) % len(self.sentences)] for j in range(2))
            for q in range(n_prompts)
        ]
        self.t0 = 1_767_225_600_000_000  # 2026-01-01 in µs

    def _text(self, n: int, k: int, most: int | None = None) -> list[str]:
        """``n`` texts of ``k`` sentences (10-13 words each), or of ``k`` to ``most``."""
        top = most or k
        picks = self.sentences[self.rng.integers(0, len(self.sentences), (n, top))]
        if most is None:
            return [" ".join(row) for row in picks]
        counts = self.rng.integers(k, top + 1, n)
        return [" ".join(row[:c]) for row, c in zip(picks, counts, strict=True)]

    def _tool_texts(self, names: Any, a: Any, b: Any, errs: Any) -> tuple[list[str], list[Any]]:
        """Arguments (JSON) and results of tool calls as an agent makes them."""
        n = len(names)
        if self.shape.short_text:
            return ([f'{{"expression": "{x} * {y}"}}' for x, y in zip(a, b, strict=True)],
                    [None if e else str(int(x) * int(y)) for e, x, y in zip(errs, a, b,
                                                                          strict=True)])
        queries = self._text(n, 1)
        found = self._text(n, 2, 4)  # 20-50 words
        args, results = [], []
        for i in range(n):
            name, x, y = names[i], int(a[i]), int(b[i])
            if name == "calculator":
                args.append(f'{{"expression": "{x} * {y}"}}')
                text = f"{x} * {y} = {x * y}. {found[i]}"
            elif name == "search":
                words = " ".join(queries[i].split()[:5]).rstrip(".")
                args.append(json.dumps({"query": words, "top_k": 3}))
                text = found[i]
            else:
                args.append(json.dumps({"code": f"print({x} * {y})"}))
                text = f"{x * y}\n{found[i]}"
            results.append(None if errs[i] else text)
        return args, results

    def page(self, first: int, count: int) -> dict[str, pa.Table]:
        s, rng = self.shape, self.rng
        idx = np.arange(first, first + count)
        step = idx // s.per_step + 1
        in_step = idx % s.per_step
        sample = in_step // s.group
        rollout = in_step % s.group
        samples_per_step = max(1, s.per_step // s.group)
        validate = sample % 20 == 19
        prompt_no = ((step - 1) * samples_per_step + sample) % len(self.questions)
        prompt = [self.questions[int(q)] for q in prompt_no]
        ids = _hex_ids(rng, count, 16)
        # rewards: a sample's difficulty decides how often its rollouts succeed, so some groups
        # are all 0 or all 1 (zero variance) and the mean rises with the step
        difficulty = (prompt_no * 2654435761 % 1000) / 1000.0
        p_ok = np.clip(1.2 - difficulty + step / (4.0 * s.steps), 0.0, 1.0)
        reward = (rng.random(count) < p_ok).astype(np.float64)
        truncated = rng.random(count) < 0.04
        finish = np.where(truncated, "length", "stop")
        tool_err = rng.random((count, TURNS)) < 0.03
        n_err = tool_err.sum(axis=1)
        resp_tok = rng.integers(60, 140, (count, TURNS))
        start = self.t0 + idx * 50_000 + rng.integers(0, 1000, count)
        latency = rng.gamma(4.0, 300.0, count)
        responses = self._text(count * TURNS, 4) if s.short_text else \
            self._text(count * TURNS, 6, 8)  # 60-104 words  # fmt: skip
        kl = rng.gamma(1.5, 0.002, count)
        flags = [["truncated"] if t else [] for t in truncated]
        for i in np.flatnonzero(n_err >= 2):
            flags[i].append("tool_error_burst")
        kept = np.where(n_err > 0, "errors", "sampled")
        traj = {
            "trace_id": ids,
            "experiment": [s.experiment] * count,
            "experiment_name": [f"{s.experiment}-grpo"] * count,
            "name": ["agent_loop"] * count,
            "step": step,
            "sample_index": sample,
            "sample_key": [str(int(x)) for x in sample],
            "rollout_n": rollout,
            "validate": validate,
            "attempt": [0] * count,
            "policy_version": [f"v{int(x)}" for x in step],
            "worker_id": [f"worker-{int(x)}" for x in idx % WORKERS],
            "status": ["OK"] * count,
            "start_time": start,
            "latency_ms": latency,
            "prompt": prompt,
            "prompt_text": [f"<|user|>{p}" for p in prompt],
            "response_text": responses[TURNS - 1 :: TURNS],
            "messages": [json.dumps([{"role": "user", "content": p}]) for p in prompt],
            "reward": reward,
            "num_turns": np.full(count, TURNS),
            "num_tool_calls": np.full(count, TURNS),
            "num_tool_errors": n_err,
            "finish_reason": finish,
            "prompt_tokens": rng.integers(40, 120, count),
            "response_tokens": resp_tok.sum(axis=1),
            "error": [None] * count,
            "mismatch_kl_mean": kl,
            "mismatch_kl_max": kl * 8,
            "ref_kl_mean": kl * 3,
            "ref_kl_max": kl * 20,
            "logprob_min": -rng.gamma(3.0, 2.0, count),
            "logprob_mean": -rng.gamma(2.0, 0.15, count),
            "entropy_mean": rng.gamma(2.0, 0.3, count),
            "accuracy": reward,
            "flags": flags,
            "kept_by": kept,
            "end_reason": ["completed"] * count,
        }
        rep = np.repeat(np.arange(count), TURNS)
        pos = np.tile(np.arange(TURNS), count)
        turns = {
            "trace_id": [ids[i] for i in rep],
            "step": step[rep],
            "turn_index": pos,
            "span_id": _hex_ids(rng, count * TURNS, 8),
            "name": ["generate"] * (count * TURNS),
            "start_time": start[rep] + pos * 400_000,
            "latency_ms": rng.gamma(3.0, 100.0, count * TURNS),
            "prompt_text": [prompt[i] for i in rep],
            "response_text": responses,
            "reasoning": [None] * (count * TURNS),
            "prompt_tokens": rng.integers(40, 400, count * TURNS),
            "response_tokens": resp_tok.reshape(-1),
            "finish_reason": np.where(pos == TURNS - 1, finish[rep], "stop"),
            "logprobs": [None] * (count * TURNS),
            "status": ["OK"] * (count * TURNS),
            "error": [None] * (count * TURNS),
        }
        errs = tool_err.reshape(-1)
        a = rng.integers(2, 999, count * TURNS)
        b = rng.integers(2, 999, count * TURNS)
        tool_names = np.array(TOOLS)[rng.integers(0, len(TOOLS), count * TURNS)]
        arguments, results = self._tool_texts(tool_names, a, b, errs)
        calls = {
            "trace_id": turns["trace_id"],
            "step": step[rep],
            "call_index": pos,
            "turn_index": pos,
            "span_id": _hex_ids(rng, count * TURNS, 8),
            "name": tool_names,
            "arguments": arguments,
            "result": results,
            "error": ["timeout after 30 s" if e else None for e in errs],
            "status": np.where(errs, "ERROR", "OK"),
            "start_time": turns["start_time"] + 200_000,
            "latency_ms": rng.gamma(2.0, 20.0, count * TURNS),
        }
        lay_out(self.time_rng, start, traj, turns, calls, TURNS)  # benchmarks/timing_data.py
        if s.scenario:
            from benchmarks.patterns_data import SCENARIOS

            SCENARIOS[s.scenario](rng, step, prompt_no, traj, turns, calls, TURNS)
        _sign(traj, calls)
        out = {"trajectories": traj, "turns": turns, "tool_calls": calls}
        tables = {name: pa.Table.from_pydict(cols, schema=arrow_schema(name))
                  for name, cols in out.items()}  # fmt: skip
        if s.tokens_per_turn:
            tables["tokens"] = self._tokens(ids, step, sample, rollout, count)
        return tables

    def _tokens(self, ids: list[str], step: Any, sample: Any, rollout: Any, count: int) -> Any:
        k = self.shape.tokens_per_turn * TURNS
        rows = count * k
        owner = np.repeat(np.arange(count), k)
        pos = np.tile(np.arange(k), count)
        token_id = self.rng.integers(0, len(self.token_vocab), rows)
        roll = -self.rng.gamma(1.0, 0.4, rows)
        train = roll + self.rng.normal(0.0, 0.05, rows)
        ref = train + self.rng.normal(0.0, 0.1, rows)
        d1, d2 = train - roll, ref - train
        cols = {
            "trace_id": pa.array(ids).take(pa.array(owner)),
            "step": step[owner],
            "sample_index": sample[owner],
            "rollout_n": rollout[owner],
            "turn": pos // self.shape.tokens_per_turn,
            "position": pos,
            "token_id": token_id,
            "token": self.token_vocab.take(pa.array(token_id)),
            "loss_mask": np.ones(rows, dtype=np.int64),
            "rollout_logprob": roll,
            "train_logprob": train,
            "ref_logprob": ref,
            "entropy": self.rng.gamma(2.0, 0.3, rows),
            "advantage": np.repeat(self.rng.normal(0.0, 1.0, count), k),
            "mismatch_kl": np.exp(d1) - 1 - d1,
            "mismatch_kl_k1": -d1,
            "ref_kl": np.exp(d2) - 1 - d2,
            "ref_kl_k1": -d2,
        }
        return pa.Table.from_pydict(cols, schema=arrow_schema("tokens"))


def _sign(traj: dict[str, Any], calls: dict[str, Any]) -> None:
    """The behaviour signature, behaviour and reward parts columns, as an export computes them
    (tracer/readers/rows.py)."""
    made: dict[str, list[tuple[str, bool]]] = {}
    for trace_id, name, error in zip(calls["trace_id"], calls["name"], calls["error"],
                                     strict=True):  # fmt: skip
        made.setdefault(trace_id, []).append((str(name), error is not None))
    sigs = [signature(made.get(t, []), str(f), None, text) for t, f, text in
            zip(traj["trace_id"], traj["finish_reason"], traj["response_text"], strict=True)]
    traj["signature"] = [x.key for x in sigs]
    traj["signature_text"] = [x.text for x in sigs]
    traj["behaviour"] = [behaviour((n for n, _ in made.get(t, [])), str(f), text, tokens)
                         for t, f, text, tokens in zip(traj["trace_id"], traj["finish_reason"],
                                                       traj["response_text"],
                                                       traj["response_tokens"], strict=True)]
    traj["reward_parts"] = [{"score": float(r), "acc": float(a)}
                            for r, a in zip(traj["reward"], traj["accuracy"], strict=True)]


def generate(out: str, n: int, *, steps: int | None = None, group: int = 4,
             tokens_per_turn: int = 0, seed: int = 0, experiment: str = "bench",
             progress: bool = False, scenario: str = "",
             short_text: bool = False) -> dict[str, int]:  # fmt: skip
    """Write the tables of ``n`` trajectories into folder ``out``; returns rows per table."""
    os.makedirs(out, exist_ok=True)
    steps = steps or max(1, min(100, n // 400))
    shape = Shape(n=n, steps=steps, group=group, tokens_per_turn=tokens_per_turn,
                  experiment=experiment, scenario=scenario, short_text=short_text)  # fmt: skip
    gen = Generator(shape, seed)
    names = ["trajectories", "turns", "tool_calls"] + (["tokens"] if tokens_per_turn else [])
    writers = {name: pq.ParquetWriter(os.path.join(out, f"{name}.parquet"), arrow_schema(name),
                                      compression="zstd") for name in names}  # fmt: skip
    rows = dict.fromkeys(names, 0)
    t0 = time.perf_counter()
    try:
        for first in range(0, n, PAGE):
            tables = gen.page(first, min(PAGE, n - first))
            for name, table in tables.items():
                writers[name].write_table(table, row_group_size=len(table))
                rows[name] += len(table)
            if progress and (first // PAGE) % 200 == 0:
                print(f"  {first + PAGE:,} / {n:,} ({time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        for w in writers.values():
            w.close()
    rows["steps"] = write_steps(os.path.join(out, "trajectories.parquet"), out, "parquet")[1]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--group", type=int, default=4, help="rollouts per sample (GRPO n)")
    p.add_argument("--tokens-per-turn", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scenario", default="", choices=["", "hacking"],
                   help="a behaviour scenario (benchmarks/patterns_data.py)")
    p.add_argument("--short-text", action="store_true",
                   help="responses of ~45 words, one-number tool results (the old shape)")
    args = p.parse_args()
    t0 = time.perf_counter()
    rows = generate(args.out, args.n, steps=args.steps, group=args.group,
                    tokens_per_turn=args.tokens_per_turn, seed=args.seed, progress=True,
                    scenario=args.scenario, short_text=args.short_text)
    print(f"wrote {rows} in {time.perf_counter() - t0:.1f} s to {args.out}")


if __name__ == "__main__":
    main()
