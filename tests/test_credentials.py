"""No credential reaches the disk or the logs: destination.json keeps an allowlist (a store's
scheme, host, port and path, and the names of the environment variables replay reads), and
replay still finds the store, taking its credentials from the environment."""

from __future__ import annotations

import base64
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

import tracer
from tests._servers import free_port
from tracer.config import TraceConfig
from tracer.credentials import store_address
from tracer.replay import replay
from tracer.spool import BackendSpool

AZURE_SIG = "AzSig0123456789abcdefXYZ%3D"
AWS_SIG = "f0e1d2c3b4a5968778695a4b3c2d1e0f"
AWS_KEY_ID = "AKIAIOSFODNN7EXAMPLE"
PASSWORD = "hunter2-pw"
BEARER = "sk-live-abcdefghijklmnop"
API_KEY = "hcaik_01234567890abcdef"
SALT = "run-salt-0f1e2d3c4b5a"

SECRETS = (AZURE_SIG, "AzSig0123", AWS_SIG, AWS_KEY_ID, PASSWORD, "alice:", BEARER, API_KEY,
           SALT)  # fmt: skip

QUERIES = {
    "azure-sas": f"?sv=2022-11-02&ss=b&srt=o&sp=rw&se=2030-01-01&sig={AZURE_SIG}",
    "aws-presigned": (
        "?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        f"&X-Amz-Credential={AWS_KEY_ID}%2F20260101%2Fus-east-1%2Fs3%2Faws4_request"
        f"&X-Amz-Date=20260101T000000Z&X-Amz-Expires=3600&X-Amz-Signature={AWS_SIG}"
    ),
    "user-password": "",
}


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def _assert_nowhere(texts: dict[str, str]) -> None:
    for where, text in texts.items():
        for secret in SECRETS:
            assert secret not in text, f"{secret!r} in {where}"


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver that records what each request carried."""

    seen: list[dict[str, Any]]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.seen.append(
            {
                "path": self.path,
                "headers": {k.lower(): v for k, v in self.headers.items()},
                "bytes": len(body),
            }
        )
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _start(port: int, seen: list[dict[str, Any]]) -> HTTPServer:
    handler = type("Handler", (_Collector,), {"seen": seen})
    server = HTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("case", list(QUERIES))
@pytest.mark.waits  # mostly a timeout's wait: ordered early (tests/conftest.py)
def test_no_credential_on_disk_or_in_logs_and_replay_reads_them_from_the_environment(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()  # nothing listens during the run: every batch stays in the spool
    login = f"alice:{PASSWORD}@" if case == "user-password" else ""
    address = f"http://127.0.0.1:{port}/v1/traces"
    endpoint = f"http://{login}127.0.0.1:{port}/v1/traces{QUERIES[case]}"
    spool = tmp_path / "spool"
    with caplog.at_level(logging.DEBUG):
        tracer.init(
            backend="otlp",
            otlp_endpoint=endpoint,
            otlp_headers={"Authorization": f"Bearer {BEARER}", "x-honeycomb-team": API_KEY},
            run_salt=SALT,
            redact_patterns=[PASSWORD],
            spool_dir=str(spool),
            export_max_retries=0,
            export_timeout_s=1,
            # longer than one export attempt: shutdown waits for the worker. With less, a
            # worker still inside OTel's own retries reached the collector started below and
            # emptied the spool before replay could (2 runs in 6 under load)
            shutdown_timeout_s=5,
            flush_interval_s=0.05,
        )

        @tracer.trace_op(kind="tool")
        def tool(x: int) -> int:
            return x

        for i in range(3):
            with tracer.trace_attr(step=0, sample_index=i, rollout_n=0):
                tool(i)
        assert tracer.flush(1) is False  # the batches wait in the spool
        tracer.reset()
    files = _files(spool)
    assert len([p for p in files if p.suffix == ".jsonl"]) >= 1
    [meta_file] = [p for p in files if p.name == "destination.json"]
    _assert_nowhere({str(p): p.read_bytes().decode(errors="replace") for p in files})
    # The tracer's own lines. (OpenTelemetry's OTLP exporter logs the endpoint it failed to
    # reach, query string included, on its own logger: a URL credential reaches the logs of
    # every OTel user that way; the tracer installs no filter on another library's logger.)
    ours = [r for r in caplog.records if r.name.split(".")[0] in ("tracer", "rollout")]
    assert any("127.0.0.1" in r.getMessage() for r in ours)  # the lines that name the store
    _assert_nowhere({"tracer's logs": "\n".join(r.getMessage() for r in ours)})
    meta = json.loads(meta_file.read_text())
    assert meta["destination"] == address and meta["config"]["otlp_endpoint"] == address
    assert "OTEL_EXPORTER_OTLP_HEADERS" in meta["credentials_from_environment"]
    assert "run_salt" not in meta["config"] and "otlp_headers" not in meta["config"]

    # Replay, with the credentials where the run's operator keeps them: the environment.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"Authorization=Bearer%20{BEARER}")
    seen: list[dict[str, Any]] = []
    server = _start(port, seen)
    try:
        result = replay(str(spool))
    finally:
        server.shutdown()
        server.server_close()
    assert result.ok and sum(result.replayed.values()) == 3, result
    # the endpoint's user:password becomes HTTP Basic auth (requests puts it over the header)
    basic = "Basic " + base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
    auth = basic if case == "user-password" else f"Bearer {BEARER}"
    assert seen and all(r["headers"].get("authorization") == auth for r in seen)
    assert all(r["path"] == f"/v1/traces{QUERIES[case]}" for r in seen)


@pytest.mark.parametrize(
    ("destination", "address"),
    [
        (f"postgresql://mlflow:{PASSWORD}@db.internal:5432/mlflow", "postgresql://db.internal:5432/mlflow"),
        (f"postgresql+psycopg2://mlflow:{PASSWORD}@db:5432/x?sslpassword={PASSWORD}", "postgresql+psycopg2://db:5432/x"),
        (f"mlflow:{PASSWORD}@db:5432/x", "db:5432/x"),
        (f"https://acct.blob.core.windows.net/c/mlflow.db{QUERIES['azure-sas']}", "https://acct.blob.core.windows.net/c/mlflow.db"),
        (f"https://bucket.s3.amazonaws.com/mlflow{QUERIES['aws-presigned']}", "https://bucket.s3.amazonaws.com/mlflow"),
    ],
)  # fmt: skip
def test_destination_json_keeps_scheme_host_port_and_path(
    destination: str, address: str, tmp_path: Path
) -> None:
    config = TraceConfig(backend=None, tracking_uri=destination, run_salt=SALT,
                         redact_patterns=[PASSWORD], otlp_headers={"api-key": API_KEY})  # fmt: skip
    spool = BackendSpool(str(tmp_path), "mlflow", f"{destination}#3", config, 1 << 20)
    spool.write([b'{"trace_id": "00"}'])
    spool.release()
    _assert_nowhere({str(p): p.read_bytes().decode(errors="replace") for p in _files(tmp_path)})
    meta = json.loads((spool.dir / "destination.json").read_text())
    assert meta["destination"] == address == meta["config"]["tracking_uri"]
    assert store_address(destination) == address
    assert {"PGPASSWORD", "MLFLOW_TRACKING_TOKEN"} <= set(meta["credentials_from_environment"])
    # what replay rebuilds the exporter from is all there
    assert meta["config"]["project_name"] == "rollout-tracer"
    assert meta["config"]["export_timeout_s"] == config.export_timeout_s
