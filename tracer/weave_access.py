"""How to reach a Weave trace server, shared by the weave backend (writer) and the weave reader,
so that neither depends on the other. Imports weave only inside its functions."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from tracer.config import TraceConfig

_server_factory: Callable[[TraceConfig], Any] | None = None


def set_server_factory(factory: Callable[[TraceConfig], Any] | None) -> None:
    """Make every new Weave exporter and reader talk to ``factory(config)`` instead of the W&B
    cloud (``None`` restores the default). For tests and self-hosted in-process servers."""
    global _server_factory
    _server_factory = factory


def server_factory() -> Callable[[TraceConfig], Any] | None:
    return _server_factory


def resolve_entity(config: TraceConfig, fallback: str | None) -> str | None:
    """The W&B entity: the config's, else ``WANDB_ENTITY``, else ``fallback``."""
    return config.weave_entity or os.environ.get("WANDB_ENTITY") or fallback


def reading_server(project: str, entity: str | None = None) -> tuple[Any, str, str]:
    """(trace server, entity, project) for reading ``[entity/]project``: the server injected
    with ``set_server_factory`` (tests), else the process's Weave client for
    that project, else the W&B cloud (or ``WF_TRACE_SERVER_URL``) with ``WANDB_API_KEY``.
    Raises ValueError with what to set; never creates a project."""

    if "/" in project:
        entity, project = project.split("/", 1)
    config = TraceConfig(project_name=project, weave_entity=entity)
    factory = _server_factory
    if factory is not None:
        return factory(config), resolve_entity(config, "rollout-tracer") or "", project
    from weave.trace import env as weave_env
    from weave.trace.context.weave_client_context import get_weave_client
    from weave.trace.weave_init import get_entity_project_from_project_name, init_weave_get_server
    from weave.wandb_interface.context import get_wandb_auth_context

    entity = resolve_entity(config, None)
    current = get_weave_client()
    if current is not None and current.project == project and entity in (None, current.entity):
        return current.server, str(current.entity), project
    url = weave_env.weave_trace_server_url()
    credentials = get_wandb_auth_context()
    if credentials is None:
        raise ValueError(
            "reading from Weave needs W&B credentials: set WANDB_API_KEY (or run `wandb "
            f"login`); trace server {url} (WF_TRACE_SERVER_URL for a self-hosted server)"
        )
    server = init_weave_get_server(credentials)
    try:
        server.server_info()
    except Exception as exc:
        raise ValueError(
            f"Weave trace server {url} is not reachable ({type(exc).__name__}: {exc})"
        ) from exc
    if entity is None:
        entity, _ = get_entity_project_from_project_name(project)
    return server, str(entity), project
