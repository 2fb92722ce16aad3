"""MLflow's UI needs its server's /graphql (the experiment page asks it first): the installed
graphene / graphql-core pair must work with every extra installed (weave's gql included)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests._servers import MlflowServer

pytest.importorskip("mlflow")


def _graphql(url: str, query: str) -> tuple[int, dict]:
    body = json.dumps({"query": query}).encode()
    request = urllib.request.Request(f"{url}/graphql", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as resp:
        return resp.status, json.loads(resp.read())


def test_graphql_answers_the_experiment_page_query(mlflow_server: MlflowServer) -> None:
    exp_id = mlflow_server.experiment_id("graphql-check")
    query = ('query { mlflowGetExperiment(input: {experimentId: "EXP"}) '
             "{ experiment { experimentId name } } }").replace("EXP", exp_id)  # fmt: skip
    status, answer = _graphql(mlflow_server.url, query)
    assert status == 200 and not answer.get("errors"), answer
    experiment = answer["data"]["mlflowGetExperiment"]["experiment"]
    assert experiment == {"experimentId": exp_id, "name": "graphql-check"}
    status, answer = _graphql(mlflow_server.url, 'query { test(inputString: "ok") { output } }')
    assert (status, answer["data"]["test"]["output"]) == (200, "ok")


def test_installed_graphene_imports_from_graphql_core() -> None:
    # graphene 2 with graphql-core 3 was the failure (ImportError: ResolveInfo): MLflow's
    # schema module is what the server imports
    import graphene
    from mlflow.server.graphql import graphql_schema_extensions  # noqa: F401

    assert int(graphene.__version__.split(".")[0]) >= 3
