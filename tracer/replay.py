"""Replay what a spool holds into its backends: ``rollout-tracer replay`` and ``replay()``.

Each spool folder names its backend and the trace config it was written with, so replay needs
no other configuration. Credentials are never stored (tracer/credentials.py): a store's address
is kept as scheme, host, port and path, and the credentials come from the environment, as for
the run: the backend's own variables (``PGPASSWORD``, ``OTEL_EXPORTER_OTLP_HEADERS``...), or
a full URI in ``MLFLOW_TRACKING_URI`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` that names the
same store (its query string, a SAS or presigned signature, is then used). Only batch files
whose owner is gone are taken (a live tracer replays its own; see tracer/spool.py); exports
are idempotent, so a batch replayed twice is stored once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tracer.backends import create_exporter
from tracer.backends.base import ExportResult, as_exporter
from tracer.config import TraceConfig
from tracer.credentials import store_address
from tracer.spool import BackendSpool, read_batch, spool_folders

log = logging.getLogger("tracer")


# A stored store address (scheme, host, port, path) and the variable that may hold its full URI.
_ADDRESS_ENV = {"tracking_uri": "MLFLOW_TRACKING_URI",
                "otlp_endpoint": "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"}  # fmt: skip


def _full_addresses(stored: dict[str, Any]) -> None:
    """Where the environment holds the full URI of a stored address, use it."""
    for field_name, env in _ADDRESS_ENV.items():
        address, full = stored.get(field_name), os.environ.get(env)
        if address and full and store_address(full) == address:
            stored[field_name] = full


@dataclass
class ReplayResult:
    replayed: dict[str, int] = field(default_factory=dict)  # backend folder -> trajectories
    failed: dict[str, str] = field(default_factory=dict)  # backend folder -> why
    left: dict[str, int] = field(default_factory=dict)  # batch files still waiting

    @property
    def ok(self) -> bool:
        return not self.failed


def replay(spool_dir: str, overrides: dict[str, Any] | None = None,
           progress: Callable[[int], None] | None = None) -> ReplayResult:
    """Export every orphaned batch under ``spool_dir``; delete each once its backend has it.

    ``overrides`` replace fields of the stored config (e.g. a new ``tracking_uri`` when the
    server moved). ``progress`` is called with the number of trajectories after each batch.
    """
    result = ReplayResult()
    for folder, meta in spool_folders(spool_dir):
        name = meta["backend"]
        stored = dict(meta.get("config") or {})
        _full_addresses(stored)
        stored.update(overrides or {})
        stored.update({"backend": [name], "spool_dir": spool_dir})
        try:
            config = TraceConfig.from_mapping(
                {k: v for k, v in stored.items() if k in TraceConfig.__dataclass_fields__})
            exporter = as_exporter(create_exporter(name, config))
        except Exception as exc:
            result.failed[folder.name] = f"cannot start backend {name}: {exc}"
            continue
        spool = BackendSpool(spool_dir, name, exporter.spool_key,
                             config, config.max_spool_bytes, folder=folder)
        done = 0
        try:
            for orphan in spool.orphans():
                path = spool.claim(orphan)
                if path is None:
                    continue  # taken by another replay or a live tracer
                try:
                    records = read_batch(path)
                except (OSError, ValueError) as exc:
                    result.failed[folder.name] = f"cannot read {path.name}: {exc}"
                    continue
                try:  # replay=True: it may be stored already, check before adding
                    ok = not records or (
                        exporter.export(records, replay=True) is not ExportResult.FAILURE)
                except Exception as exc:
                    ok = False
                    result.failed[folder.name] = f"{type(exc).__name__}: {exc}"
                if not ok:
                    result.failed.setdefault(folder.name, "export failed")
                    break
                spool.delete(path)
                done += len(records)
                if progress is not None:
                    progress(len(records))
        finally:
            spool.release()  # what failed is an orphan again, for the next replay
            try:
                exporter.shutdown()
            except Exception as exc:  # replay is done; report and go on
                log.warning("rollout-tracer: shutting down %s after replay: %s", name, exc)
        result.replayed[folder.name] = done
        result.left[folder.name] = len(spool.orphans())
    return result
