"""The README's pictures of the explorer and of the export, from a real run's MLflow store.

    rollout-tracer run                       # the main job: ./mlflow.db
    python scripts/docs_screenshots.py --tracking-uri sqlite:///mlflow.db --out docs/img

Exports the run with `rollout-tracer export`, serves it with `rollout-tracer explore` on a free
port of 127.0.0.1, and takes both pictures with Playwright driving Debian's chromium
(`--chromium`, default /usr/bin/chromium): the explorer's list of a step's training
trajectories, and a DuckDB query over the export's `trajectories.parquet` rendered as text.
"""

from __future__ import annotations

import argparse
import html
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

QUERY = """SELECT step, sample_index AS sample, rollout_n AS n, reward, num_turns AS turns,
       num_tool_calls AS tools, finish_reason AS finish, response_tokens AS tokens,
       round(mismatch_kl_mean, 3) AS kl_mean
FROM 'exports/trajectories.parquet' WHERE NOT validate ORDER BY step, sample, n"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, proc: subprocess.Popen[bytes], deadline_s: float = 120.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"the explorer exited with status {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"the explorer did not answer at {url} within {deadline_s:.0f} s")


def _export_picture(page: Any, exports: Path, out: Path) -> None:
    import duckdb

    con = duckdb.connect()
    rel = con.sql(QUERY.replace("'exports/", f"'{exports}/"))
    text = f"D {QUERY}\n{rel}"
    body = f"<pre>{html.escape(text)}</pre>"
    style = ("body{margin:0;background:#1e1e1e}pre{color:#ddd;font:13px/1.35 "
             "'DejaVu Sans Mono',monospace;padding:14px;margin:0;display:inline-block}")
    page.set_content(f"<html><head><style>{style}</style></head><body>{body}</body></html>")
    page.locator("pre").screenshot(path=str(out))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tracking-uri", required=True)
    p.add_argument("--experiment", default="rollout-tracer")
    p.add_argument("--out", default="docs/img")
    p.add_argument("--step", type=int, default=1)
    p.add_argument("--chromium", default="/usr/bin/chromium")
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="docs-shots-"))
    exports = work / "exports"
    cli = [sys.executable, "-m", "rollout.cli"]
    subprocess.run([*cli, "export", "--from", "mlflow", "--tracking-uri", args.tracking_uri,
                    "--experiment", args.experiment, "--out", str(exports), "--no-progress"],
                   check=True)  # fmt: skip
    port = _free_port()
    base = f"http://127.0.0.1:{port}/"
    server = subprocess.Popen([*cli, "explore", "--from", "parquet", "--path", str(exports),
                               "--port", str(port), "--cache-dir", str(work / "cache"),
                               "--no-progress"], start_new_session=True)  # fmt: skip
    try:
        _wait_http(base, server)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, headless=True,
                                         args=["--no-sandbox", "--disable-gpu"])  # fmt: skip
            page = browser.new_page(viewport={"width": 1280, "height": 640})
            page.goto(f"{base}#/list?step={args.step}&validate=false")
            page.wait_for_function("document.body.dataset.ready === location.hash",
                                   timeout=60_000)  # fmt: skip
            page.screenshot(path=str(out / "explore.png"))
            _export_picture(page, exports, out / "export.png")
            browser.close()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    print(f"wrote {out / 'explore.png'} and {out / 'export.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
