"""A real run for the token view: the default rollout (SmolLM2 on the CPU, transformers engine)
with the engine's log-probs (calculate_log_probs=True), a bfloat16 "trainer" pass attached with
tracer.annotate, then the report, and with --screenshot the picture in docs/kl-heatmap.png.

    python scripts/token_view_demo.py --out /tmp/token-view [--screenshot docs/kl-heatmap.png]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    sys.path.insert(0, str(ROOT))  # run from a checkout: this tree's tracer and rollout
    import tracer
    from rollout.config import load_config, trace_config
    from rollout.engines import make_engine
    from rollout.models import load_model
    from rollout.trainer_pass import annotate_step
    from rollout.worker import RolloutWorker
    from tracer.readers import read_tables, write_report

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="token-view")
    ap.add_argument("--screenshot", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    jsonl = os.path.join(args.out, "traces.jsonl")
    config = load_config(["actor_rollout_ref.rollout.calculate_log_probs=true",
                          "actor_rollout_ref.rollout.trace.backend=jsonl",
                          f"+actor_rollout_ref.rollout.trace.jsonl_path={jsonl}",
                          *args.overrides], str(ROOT / "config" / "rollout.yaml"))  # fmt: skip
    trace = trace_config(config)
    trace["run_salt"] = tracer.new_run_salt()
    tracer.init(trace)
    engine = make_engine(config)
    path = config["actor_rollout_ref"]["model"]["path"]
    trainer, tokenizer = load_model(path, dtype="bfloat16")
    worker = RolloutWorker(config, engine)

    async def run() -> None:
        try:
            steps = int(config["trainer"]["total_steps"])
            await worker.run(steps, on_step=lambda r: print(r.step, annotate_step(r, trainer)))
        finally:
            await engine.close()

    asyncio.run(run())
    assert tracer.flush(timeout_s=120)
    tracer.shutdown()
    tables = read_tables("jsonl", path=jsonl, tokenizer=tokenizer)
    report = write_report(tables, os.path.join(args.out, "report.html"), "token view: SmolLM2")
    print(report, len(tables.tokens), "tokens")
    if args.screenshot:
        screenshot(Path(report), args.screenshot)


def screenshot(report: Path, out: str) -> None:
    """The heatmap and the coloured transcript of the trajectory with the largest KL."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(report.parent / "chromium-profile"), headless=True,
            executable_path=os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium"),
            viewport={"width": 1240, "height": 900}, args=["--no-sandbox", "--disable-gpu"],
        )  # fmt: skip
        page = browser.new_page()
        page.goto(report.as_uri())
        page.locator('#token-top .top[data-column="mismatch_kl_max"] a').first.click()
        page.select_option("#tok-metric", "mismatch_kl")
        page.evaluate("""() => {
            for (const id of ['rewards', 'trends', 'groups', 'prompts'])
                document.getElementById(id)?.remove();
            document.querySelector('#viewer .meta').remove();
        }""")
        page.screenshot(path=out, full_page=True)
        browser.close()


if __name__ == "__main__":
    main()
