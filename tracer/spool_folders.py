"""Where a spool's folders are and what each says about its destination: the default spool
root, the folder of one backend destination, the folders under a root, and the
``destination.json`` a folder keeps for ``rollout-tracer replay``.

``destination.json`` holds what replay needs to rebuild the exporter and find the store, chosen
by an allowlist (tracer/credentials.py): the backend name, the store's scheme, host, port and
path, the config fields an exporter reads (names, paths, timeouts; URIs reduced the same way),
and the names, never the values, of the environment variables replay reads credentials from.
The batch files beside it are ``tracer.spool``'s.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tracer.credentials import REPLAY_ENV, store_address

DESTINATION_FILE = "destination.json"


def default_spool_dir() -> str:
    return os.path.join(os.getcwd(), ".rollout-tracer", "spool")


def spool_folder(root: str, backend: str, destination: str) -> Path:
    """The folder of one backend destination (its name never contains credentials)."""
    digest = hashlib.sha1(f"{backend}|{destination}".encode()).hexdigest()[:12]
    return Path(root) / f"{backend}-{digest}"


def spool_folders(root: str) -> list[tuple[Path, dict[str, Any]]]:
    """Every backend folder under a spool root with its destination.json."""
    out: list[tuple[Path, dict[str, Any]]] = []
    base = Path(root)
    if not base.is_dir():
        return out
    for d in sorted(base.iterdir()):
        meta = d / DESTINATION_FILE
        if d.is_dir() and meta.exists():
            out.append((d, json.loads(meta.read_text())))
    return out


def strip_credentials(destination: str) -> str:
    """A backend's destination (its spool key) as it may be written down: the store's scheme,
    host, port and path. What follows ``|`` in a key (OTLP routing headers) is dropped."""
    return store_address(destination.split("|", 1)[0])


# The config fields replay hands back to an exporter (everything an exporter reads). Anything
# else (run_salt, redaction patterns, header values, callables) is never written.
_REPLAY_FIELDS = ("project_name", "experiment_name", "worker_id", "weave_entity",
                  "mlflow_run_id", "jsonl_path", "export_timeout_s", "export_batch_size",
                  "export_max_retries", "max_spool_bytes")  # fmt: skip
_ADDRESS_FIELDS = ("tracking_uri", "otlp_endpoint")


def _config_dict(config: Any) -> dict[str, Any]:
    """The allowlisted fields of the trace config; store URIs as scheme, host, port and path."""
    out: dict[str, Any] = {}
    for name in _REPLAY_FIELDS:
        value = getattr(config, name, None)
        if value is None or isinstance(value, (str, int, float)):
            out[name] = value
    for name in _ADDRESS_FIELDS:
        value = getattr(config, name, None)
        out[name] = store_address(value) if isinstance(value, str) else None
    return out


def destination_payload(backend: str, destination: str, config: Any) -> dict[str, Any]:
    """What a folder's ``destination.json`` says: nothing the allowlists do not name."""
    return {
        "backend": backend,
        "destination": strip_credentials(destination),
        "config": _config_dict(config),
        "credentials_from_environment": list(REPLAY_ENV.get(backend, ())),
    }
