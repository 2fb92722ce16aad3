"""Which optional extra provides a missing package, and the one line a command says about it.

Every ``rollout-tracer`` command runs under :func:`rollout.cli.main`, which asks
:func:`missing_extra_line` about any exception that escapes the command: when an
``ImportError`` of an optional package is anywhere on its chain (a ``TracerInitError`` from a
backend that could not import MLflow, a reader that imports pyarrow when it first writes), the
command prints ``rollout-tracer CMD: error: NAME is not installed: pip install
'rollout-tracer[EXTRA]'`` and exits 2, with no traceback. One place, so a new command or a new
import path cannot forget it (``tests/test_missing_extras.py`` hides each package in turn).
"""

from __future__ import annotations

# top-level package -> the extra of pyproject.toml that installs it
EXTRAS = {
    "pyarrow": "export",
    "pandas": "export",
    "duckdb": "export",
    "datasketch": "export",  # near-duplicate answers (tracer/readers/habits/near_dup.py)
    "mlflow": "mlflow",
    "weave": "weave",
    "trackio": "trackio",
    "wandb": "wandb",
    "swanlab": "swanlab",
    "ray": "ray",
    "tantivy": "explore",
    "inspect_ai": "inspect",
    "psycopg2": "postgres",
    "opentelemetry": "otlp",
    "torch": "rollout",
    "transformers": "rollout",
}
# a command whose own extra holds the package: the explorer needs pyarrow, duckdb and tantivy
# and names its extra, which has all three
COMMAND_EXTRAS = {"explore": ("explore", ("pyarrow", "duckdb", "tantivy"))}


def missing_package(exc: BaseException) -> str | None:
    """The optional package whose import failed somewhere on ``exc``'s chain, or None."""
    seen: BaseException | None = exc
    for _ in range(8):  # a chain is short; a cycle must not hang us
        if seen is None:
            return None
        if isinstance(seen, ImportError):
            name = (seen.name or "").split(".")[0]
            if name in EXTRAS:
                return name
        seen = seen.__cause__ or seen.__context__
    return None


def missing_extra_line(exc: BaseException, command: str) -> str | None:
    """``NAME is not installed: pip install 'rollout-tracer[EXTRA]'`` for an exception caused
    by a missing optional package, else None (a bug: its traceback is wanted)."""
    name = missing_package(exc)
    if name is None:
        return None
    extra = EXTRAS[name]
    own = COMMAND_EXTRAS.get(command)
    if own is not None and name in own[1]:
        extra = own[0]
    return f"{name} is not installed: pip install 'rollout-tracer[{extra}]'"
