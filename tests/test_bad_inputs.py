"""Bad input never breaks the rollout and is never silently lost: a table of hostile values,
each traced as argument and result of a real op, read back from the JSONL file."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tracer


class ReprRaises:
    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")


@dataclasses.dataclass
class Turn:
    role: str
    token_ids: list[int]


def _cyclic() -> dict[str, Any]:
    d: dict[str, Any] = {"name": "loop"}
    d["self"] = d
    return d


def _pydantic() -> Any:
    pydantic = pytest.importorskip("pydantic")

    class Msg(pydantic.BaseModel):
        role: str
        content: str

    return Msg(role="user", content="hi")


def _torch_tensor() -> Any:
    torch = pytest.importorskip("torch")
    return torch.tensor([[1, 2], [3, 4]])


BIG = 10 * 1024 * 1024
# (id, factory, check(stored_json_text_of_the_argument))
CASES: list[tuple[str, Any, Any]] = [
    ("torch-cpu-tensor", _torch_tensor, lambda v: v == [[1, 2], [3, 4]]),
    ("numpy-scalar", lambda: np.int64(7), lambda v: v == 7),
    ("numpy-array", lambda: np.arange(6).reshape(2, 3), lambda v: v == [[0, 1, 2], [3, 4, 5]]),
    ("numpy-float-nan", lambda: np.float32("nan"), lambda v: v == "nan"),
    ("bytes", lambda: b"\x00\x01abc", lambda v: v.startswith("<bytes: 5 bytes>")),
    ("invalid-utf8-bytes", lambda: b"ok \xff\xfe", lambda v: "ok" in v and "\ufffd" in v),
    (
        "lone-surrogate-str",
        lambda: b"caf\xe9".decode("utf-8", "surrogateescape"),
        lambda v: v.startswith("caf") and "invalid UTF-8 replaced" in v,
    ),
    ("set", lambda: {3, 1, 2}, lambda v: v == [1, 2, 3]),
    (
        "dataclass",
        lambda: Turn("user", [1, 2]),
        lambda v: v == {"__type__": "Turn", "role": "user", "token_ids": [1, 2]},
    ),
    ("pydantic", _pydantic, lambda v: v["role"] == "user" and v["content"] == "hi"),
    ("repr-raises", ReprRaises, lambda v: "unrepresentable ReprRaises" in v),
    (
        "cyclic",
        _cyclic,
        lambda v: v["name"] == "loop" and "cyclic or too deeply nested" in json.dumps(v),
    ),
    ("10MB-string", lambda: "x" * BIG, lambda v: f"original {BIG} chars" in v and len(v) < BIG),
    (
        "million-list",
        lambda: list(range(1_000_000)),
        lambda v: "original 1000000 items" in v[-1] and len(v) < 1_000_000,
    ),
    (
        "nested-huge-dict",
        lambda: {str(i): i for i in range(100_000)},
        lambda v: "original 100000 keys" in v["__truncated__"],
    ),
    ("inf", lambda: float("inf"), lambda v: v == "inf"),
    ("complex", lambda: 1 + 2j, lambda v: v == "(1+2j)"),
]


@pytest.mark.parametrize(("case", "factory", "check"), CASES, ids=[c[0] for c in CASES])
def test_bad_value_is_recorded_with_a_marker(case: str, factory: Any, check: Any, tmp_path: Path):
    path = tmp_path / "t.jsonl"
    tracer.init(
        backend="jsonl",
        jsonl_path=str(path),
        raise_internal_errors=True,
        max_field_chars=100_000,
        max_list_items=10_000,
    )
    value = factory()

    @tracer.trace_op(kind="tool")
    def tool(arg: Any) -> Any:
        return arg

    with tracer.trace_attr(step=np.int64(1), sample_index=np.int64(3), rollout_n=np.int32(0)):
        assert tool(value) is value  # the rollout sees its own object, untouched
    assert tracer.flush(60)
    [line] = path.read_text(encoding="utf-8").splitlines()
    record = json.loads(line)
    assert (record["step"], record["sample_index"], record["rollout_n"]) == (1, 3, 0)
    span = record["spans"][1]
    assert check(span["inputs"]["arg"]), span["inputs"]["arg"]
    assert check(span["outputs"]), span["outputs"]


def test_a_tool_that_raises_and_a_generator_abandoned_are_recorded(tmp_path: Path):
    path = tmp_path / "t.jsonl"
    tracer.init(backend="jsonl", jsonl_path=str(path), raise_internal_errors=True)

    @tracer.trace_op(kind="tool")
    async def tool() -> None:
        raise KeyError("missing")

    @tracer.trace_op(kind="generate")
    async def stream():
        for i in range(100):
            yield i

    async def main() -> None:
        with tracer.trace_attr(step=0, sample_index=0):
            with pytest.raises(KeyError):
                await tool()
            agen = stream()
            assert await agen.__anext__() == 0
            await agen.aclose()

    asyncio.run(main())
    assert tracer.flush(30)
    [record] = [json.loads(x) for x in path.read_text().splitlines()]
    tool_span, gen_span = record["spans"][1:]
    assert tool_span["status"] == "ERROR" and tool_span["error"]["type"] == "KeyError"
    assert gen_span["attributes"]["generator_closed_early"] is True and gen_span["outputs"] == [0]


def test_cuda_tensor_path_is_explicit():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip(
            "no CUDA device here; CUDA tensors are kept by reference on the hot path "
            "(no copy, no sync) and moved to the CPU by the background worker"
        )
    tracer.init(backend="memory", raise_internal_errors=True)
    from tracer.testing import InMemoryExporter

    @tracer.trace_op(kind="generate")
    def gen(ids: Any) -> Any:
        return ids

    with tracer.trace_attr(step=0, sample_index=0):
        gen(torch.tensor([1, 2, 3], device="cuda"))
    assert tracer.flush(30)
    assert InMemoryExporter.latest().records[0].spans[1].outputs == [1, 2, 3]
