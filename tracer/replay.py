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
from tracer.spool import BackendSpool, is_in_doubt, read_batch
from tracer.spool_folders import spool_folders, strip_credentials

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
    # backend folder -> "<backend> -> <where>" (credentials stripped), for every folder seen
    destinations: dict[str, str] = field(default_factory=dict)
    # backend folder -> trajectories of batches marked in doubt (an export call of unknown
    # outcome had them: a shutdown's deadline, or a crash during the call; maybe stored
    # already) replayed to a sink that does not deduplicate
    in_doubt: dict[str, int] = field(default_factory=dict)
    # backend folder -> the exception behind its failure, where one was raised
    causes: dict[str, BaseException] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed


def destination_of(meta: dict[str, Any], overrides: dict[str, Any] | None = None) -> str:
    """Where a spool folder's batches go, credentials stripped: the override, else what
    destination.json says (its fields are read defensively: older and newer layouts differ)."""
    raw = meta.get("config")
    config: dict[str, Any] = raw if isinstance(raw, dict) else {}
    name = str(meta.get("backend", "?"))
    where = None
    if name == "mlflow":
        where = (overrides or {}).get("tracking_uri") or config.get("tracking_uri")
    elif name == "jsonl":
        where = (overrides or {}).get("jsonl_path") or config.get("jsonl_path")
    if not where:
        where = str(meta.get("destination") or "")
        if name == "mlflow":
            where = where.rsplit("#", 1)[0]  # "<uri>#<experiment id>"
    return strip_credentials(str(where or name))


def destination_problem(meta: dict[str, Any], spool_dir: str,
                        overrides: dict[str, Any] | None = None) -> str | None:
    """Why a folder's batches must not be sent as they are, found before anything is sent: its
    MLflow store no longer exists, or the project moved (the stored store lies outside the
    project that holds this spool, which has a store of its own)."""
    if meta.get("backend") != "mlflow" or (overrides or {}).get("tracking_uri"):
        return None
    from tracer.readers.mlflow_source import local_store_path

    uri = destination_of(meta)
    path = local_store_path(uri)
    if not path or not uri.startswith("sqlite:"):
        return None
    hint = "replay into the store you mean with --tracking-uri URI"
    if not os.path.isfile(path):
        return f"the MLflow store {path} no longer exists; {hint}"
    spool = os.path.realpath(spool_dir)
    if spool.endswith(os.path.join(".rollout-tracer", "spool")):
        project = os.path.dirname(os.path.dirname(spool))
        here = os.path.join(project, os.path.basename(path))
        stored = os.path.realpath(path)
        if os.path.dirname(stored) != project and os.path.isfile(here) and here != stored:
            return (f"this spool was written when the store was {path}, but this project "
                    f"({project}) has its own {here}: it moved or was copied; {hint} (e.g. "
                    f"--tracking-uri sqlite:///{here})")  # fmt: skip
    return None


def replay(spool_dir: str, overrides: dict[str, Any] | None = None,
           progress: Callable[[int], None] | None = None) -> ReplayResult:
    """Export every orphaned batch under ``spool_dir``; delete each once its backend has it.

    ``overrides`` replace fields of the stored config (e.g. a new ``tracking_uri`` when the
    server moved). ``progress`` is called with the number of trajectories after each batch.
    """
    result = ReplayResult()
    for folder, meta in spool_folders(spool_dir):
        name = str(meta.get("backend", ""))
        result.destinations[folder.name] = f"{name} -> {destination_of(meta, overrides)}"
        problem = destination_problem(meta, spool_dir, overrides)
        if problem:  # reported before anything is sent; the batches stay
            result.failed[folder.name] = problem
            continue
        if not any(folder.glob("*.jsonl")):  # nothing waits: no backend to start
            result.replayed[folder.name] = 0
            result.left[folder.name] = 0
            continue
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
            result.causes[folder.name] = exc  # a missing package: the command says so
            continue
        spool = BackendSpool(spool_dir, name, exporter.spool_key,
                             config, config.max_spool_bytes, folder=folder)
        done = 0
        try:
            for orphan in spool.orphans():
                path = spool.claim(orphan)
                if path is None:
                    continue  # taken by another replay or a live tracer
                doubt = is_in_doubt(path)  # an earlier call of unknown outcome had it
                try:
                    records = read_batch(path)
                except (OSError, ValueError) as exc:
                    result.failed[folder.name] = f"cannot read {path.name}: {exc}"
                    continue
                # write-ahead: marked before the call, so a replay killed during it leaves
                # the batch marked for the next one (tracer/spool.py)
                marked = spool.mark_in_doubt(path) if records else path
                if marked is None:
                    result.failed[folder.name] = f"cannot mark {path.name} in doubt"
                    break
                try:  # replay=True: it may be stored already, check before adding
                    ok = not records or (
                        exporter.export(records, replay=True) is not ExportResult.FAILURE)
                except Exception as exc:
                    ok = False
                    result.failed[folder.name] = f"{type(exc).__name__}: {exc}"
                    result.causes[folder.name] = exc
                if not ok:
                    if not doubt:  # this call's outcome is known: not stored
                        spool.unmark(marked)
                    result.failed.setdefault(folder.name, "export failed")
                    break
                spool.delete(marked)
                done += len(records)
                if doubt and not getattr(exporter, "deduplicates", True):
                    result.in_doubt[folder.name] = result.in_doubt.get(folder.name, 0) + len(
                        records)  # fmt: skip
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
