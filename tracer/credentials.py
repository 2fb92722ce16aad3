"""What of a destination may be written down (the spool's destination.json, log lines): an
allowlist, not a list of secrets to look for.

A store's address keeps its scheme, host, port and path, nothing else: no user name, password,
query string (Azure SAS ``sig=``, AWS ``X-Amz-Signature`` / ``X-Amz-Credential``, ``token=``)
or fragment. Credentials reach replay the way they reached the run: through environment
variables, listed here by name (never by value) per backend.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

# Environment variables a backend reads for its address and credentials when replay starts it
# (MLflow: its tracking-server login, and libpq's for a PostgreSQL store; OpenTelemetry's OTLP
# exporter; W&B for Weave; Hugging Face for a trackio Space).
REPLAY_ENV: dict[str, tuple[str, ...]] = {
    "mlflow": ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME",
               "MLFLOW_TRACKING_PASSWORD", "PGUSER", "PGPASSWORD", "PGPASSFILE"),
    "otlp": ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
             "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"),
    "weave": ("WANDB_API_KEY", "WANDB_BASE_URL", "WF_TRACE_SERVER_URL"),
    "trackio": ("HF_TOKEN", "TRACKIO_DIR", "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"),
    "jsonl": (),
}  # fmt: skip

# ``user:password@host...`` without a scheme (``user:pw@db:5432/x``): a colon before the @ and
# no slash, so a file name with an @ in it (``runs/a@b.jsonl``) is still a path.
_BARE_LOGIN = re.compile(r"^[^/@\s:]*:[^/@\s]*@")


def store_address(value: str) -> str:
    """``value`` as scheme, host, port and path only.

    >>> store_address("postgresql://user:pw@db:5432/mlflow?sslpassword=x")
    'postgresql://db:5432/mlflow'
    >>> store_address("user:pw@db:5432/x")
    'db:5432/x'
    """
    if _BARE_LOGIN.match(value):
        value = value.split("@", 1)[1]
    try:
        parts = urlsplit(value)
    except ValueError:  # an unparsable URL (a bad IPv6 host): its path part, if any
        return value.split("?", 1)[0].split("#", 1)[0].rsplit("@", 1)[-1]
    host = parts.netloc.rpartition("@")[2]
    scheme = value[: len(parts.scheme)]  # as written (urlsplit lowercases it)
    if value[len(scheme) :].startswith(("://", "//")):  # sqlite:///path keeps its empty host
        return f"{scheme}{':' if scheme else ''}//{host}{parts.path}"
    return f"{scheme}:{parts.path}" if scheme else parts.path
