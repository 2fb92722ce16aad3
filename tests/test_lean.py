"""The lean pipeline's shortcuts store exactly what the long way stores.

- Plain data the hot path takes as JSON (``tracer.snapshot.Json``) renders as its structural
  copy does, limits and their markers included.
- The redaction check on a serialized record never says "nothing to redact" when the per-field
  pass would change something.
- One serialization per record: byte-oriented backends receive the spool's bytes.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

import tracer
from tracer.backends import register_backend
from tracer.backends.base import Exporter, ExportResult
from tracer.encode import encode, encode_record
from tracer.jsonable import MAX_DEPTH, Limits, render_snapshot, to_jsonable
from tracer.record import SpanRecord, TrajectoryRecord, plain
from tracer.redact import Redactor
from tracer.snapshot import (
    MAX_NESTING,
    Json,
    _Budget,
    _snap,
    json_bytes,
    json_depth,
    snapshot,
    snapshot_args,
)


@dataclasses.dataclass
class Point:
    x: int
    y: float


def _deep(n: int) -> Any:
    value: Any = 1
    for _ in range(n):
        value = [value]
    return value


VALUES = [
    {"messages": [{"role": "user", "content": "hi"}], "prompt_ids": list(range(300))},
    {"text": "x" * 50, "n": 3, "ok": True, "ratio": 0.5},
    [1, 2, 3],
    {"nan": float("nan"), "inf": [1.0, float("-inf")]},  # non-finite floats become strings
    {"none": None, "a": 1},
    {"long": "y" * 500},  # past max_chars below: cut with a marker
    {"ids": list(range(100))},  # past max_items below
    _deep(MAX_NESTING + 1),  # past the structural copy's depth: JSON keeps all of it
    {"tuple": (1, 2, (3, 4))},
    {1: "int key", (2, 3): "tuple key"},
    {"bytes": b"\x00\xffraw"},
    {"set": {3, 1, 2}},
    {"point": Point(1, 2.0)},
    {"surrogate": "bad \udcff byte"},
    {"big": 2**80},
    {"unicode": "héllo wörld ✓"},
    {"text": "z" * 300, "ids": [1, 2], "ok": 1.5, "bad": float("inf")},  # a result's top level
    {"messages": [{"role": "user", "content": "w" * 300}], "n": None},
]


def _copied(value: Any) -> Any:
    """The structural copy: what the hot path takes where JSON cannot."""
    return _snap(value, _Budget(20_000), 0)


LIMITS = [Limits(200, 50), Limits(200_000, 20_000)]


@pytest.mark.parametrize("limits", LIMITS, ids=["tight", "wide"])
@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_json_snapshots_render_as_the_copy_does(value: Any, limits: Limits) -> None:
    # deeper than the structural copy goes, JSON renders as the value itself does
    copy = value if _nesting(value) > MAX_NESTING else _copied(value)
    snap, _ = snapshot(value, limits.max_items, limits.max_chars)
    assert encode(to_jsonable(snap, limits)) == encode(to_jsonable(copy, limits))
    assert encode(render_snapshot(snap, limits)) == encode(to_jsonable(copy, limits))
    args, _ = snapshot_args(("value",), (value,), {}, limits.max_items, limits.max_chars)
    assert encode(to_jsonable(args, limits)) == encode(to_jsonable({"value": copy}, limits))
    assert encode(render_snapshot(args, limits)) == encode(to_jsonable({"value": copy}, limits))


def test_plain_data_is_taken_as_json_and_the_rest_is_copied() -> None:
    generate_args, nbytes = snapshot_args(("messages", "prompt_ids"), (
        [{"role": "user", "content": "hi"}], list(range(300))), {}, 20_000)  # fmt: skip
    assert all(type(v) is Json for v in generate_args.values())
    assert nbytes >= sum(len(json_bytes(v)) for v in generate_args.values())
    result, _ = snapshot({"text": "ok", "response_ids": [1, 2], "finish_reason": "stop"})
    assert result["text"] == "ok" and result["finish_reason"] == "stop"  # read without decoding
    assert type(result["response_ids"]) is Json
    # a None, a NaN, a set, an object, a non-string key: the structural copy
    for value in ({"none": None}, [1.0, float("nan")], [{1, 2}], [Point(1, 2.0)], [{1: "a"}]):
        assert Json not in {type(snapshot(value)[0])} | {type(v) for v in snapshot_args(
            ("v",), (value,), {}, 20_000)[0].values()}, value  # fmt: skip
    # what rendering would cut is cut by the copy on the hot path: past max_items at either of
    # the top two levels, or deeper; a string past max_chars; nesting past MAX_DEPTH
    assert type(snapshot(list(range(100)), max_items=50)[0]) is not Json
    assert type(snapshot([list(range(100))], max_items=50)[0]) is not Json
    assert type(snapshot([1, [[list(range(100))]]], max_items=50)[0]) is not Json
    assert type(snapshot(["a", ["b"] * 100], max_items=50)[0]) is not Json
    assert type(snapshot(["a" * 100], max_chars=50)[0]) is not Json
    assert type(snapshot(list(range(100)), max_chars=50)[0]) is Json  # no string: no cut
    # a long context is copied, its strings shared, not encoded on the hot path
    context = [
        {"role": "user", "content": "w" * 200_000},
        {"role": "tool", "content": "x" * 100_000},
    ]
    assert (
        type(snapshot(context)[0]) is not Json
        and snapshot(context)[0][0]["content"] is context[0]["content"]
    )
    assert type(snapshot(["w" * 200_000, "x" * 100_000])[0]) is not Json


def _nesting(x: Any) -> int:
    if isinstance(x, dict):
        return 1 + max(map(_nesting, x.values()), default=0)
    if isinstance(x, list):
        return 1 + max(map(_nesting, x), default=0)
    return 0


NESTED = [_deep(100), {"a": [{"b": _deep(40)}]}, [[{}]] * 3, _deep(MAX_DEPTH),
          _deep(MAX_DEPTH + 1), [{"s": "[[[{{{ \\\" ]]}"}, ["\\", [["\""]]]]]  # fmt: skip


@pytest.mark.parametrize("value", NESTED, ids=range(len(NESTED)))
def test_json_depth_skips_strings(value: Any) -> None:
    assert json_depth(orjson.dumps(value)) == _nesting(value)


@pytest.mark.parametrize("value", [*NESTED, _deep(300)], ids=range(len(NESTED) + 1))
def test_json_keeps_what_orjson_can_nest(value: Any) -> None:
    # orjson encodes up to 254 levels: JSON keeps them all (no walk recurses into it); deeper,
    # the structural copy takes the value and marks where it stopped
    limits = Limits(200_000, 20_000)
    snap, _ = snapshot(value)
    args, _ = snapshot_args(("value",), (value,), {}, 20_000, 200_000)
    if _nesting(value) <= 254:
        top = snap.values() if type(snap) is dict else [snap]  # a dict's top level stays one
        assert all(type(v) is Json for v in top) and type(args["value"]) is Json
        assert plain(to_jsonable(snap, limits)) == value
        assert plain(to_jsonable(args, limits)) == {"value": value}
    else:
        assert type(snap) is not Json and type(args["value"]) is not Json
        assert "too deeply nested" in encode(to_jsonable(snap, limits)).decode()


def test_a_rendered_snapshot_is_not_the_callers_object() -> None:
    messages = [{"role": "user", "content": "hi"}]
    snap, _ = snapshot({"messages": messages})
    rendered = to_jsonable(snap, Limits(200_000, 20_000))
    messages.append({"role": "assistant", "content": "later"})  # the agent loop goes on
    assert plain(rendered) == {"messages": [{"role": "user", "content": "hi"}]}


SECRETS = [
    "sk-proj-abcdefghijklmnopqrstuvwx",
    "wandb_api_key=0123456789abcdefghijklmno",
    "WANDB_API_KEY: 0123456789abcdef0123456789abcdef01234567",  # a W&B key, in context
    "AKIAABCDEFGHIJKLMNOP",
    "aws_secret_access_key = abcdefghijklmnopqrstuvwxyz0123456789ABCD",
    "Authorization: Bearer abc.def-ghi_jkl",
    "hf_abcdefghijklmnopqrstuvwxyz",
    "\nsk-abcdefghijklmnopqrstuvwx",  # escaped in JSON: the check must still see it
    'quote"sk-abcdefghijklmnopqrstuvwx',
]


def _record(text: str) -> TrajectoryRecord:
    span = SpanRecord(span_id="0" * 16, parent_id=None, name="generate", kind="generate",
                      start_ns=1, end_ns=2, status="OK", error=None,
                      inputs={"messages": [{"role": "user", "content": text}]},
                      outputs={"text": "fine", "ids": list(range(50))},
                      attributes={})  # fmt: skip
    return TrajectoryRecord(trace_id="1" * 32, name="trajectory", project_name="p",
                            experiment_name="e", worker_id="w", step=0, sample_index=0,
                            rollout_n=0, validate=False, policy_version=None, reward=None,
                            status="OK", start_ns=1, end_ns=2, attributes={},
                            spans=[span])  # fmt: skip


def _changes(redactor: Redactor, text: str) -> bool:
    before = encode_record(_record(text))
    return encode_record(redactor.record(_record(text))) != before


@pytest.mark.parametrize("secret", SECRETS)
def test_the_check_sees_every_secret_the_per_field_pass_removes(secret: str) -> None:
    redactor = Redactor([])
    text = f"some prose before {secret} and after"
    assert _changes(redactor, text)
    assert redactor.needs(encode_record(_record(text)))


def test_the_check_sees_secret_environment_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_SERVICE_TOKEN", 'tok"en-with\\escapes-123')
    redactor = Redactor([])
    text = 'the value tok"en-with\\escapes-123 leaked'
    assert _changes(redactor, text) and redactor.needs(encode_record(_record(text)))


def test_the_check_is_a_superset_on_random_text() -> None:
    rng = random.Random(7)  # a private generator: the test's own, never the global one
    alphabet = "abcdef0123456789 -_=:ABKISsk\n\"'wandbearerhf"
    redactor = Redactor([])
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(5, 120)))
        if rng.random() < 0.2:
            text += rng.choice(SECRETS)
        if _changes(redactor, text):
            assert redactor.needs(encode_record(_record(text))), text


@pytest.mark.parametrize("secret", SECRETS)
def test_the_check_sees_a_secret_after_many_near_misses(secret: str) -> None:
    # the check finds a literal through one of its rare bytes; past a few dozen false hits of
    # that byte it searches the whole record: either way the secret at the end is seen
    noise = " ".join(["-", "w", "W", "A", "k", "sk", "wand", "AKI", "_", "hf"] * 40)
    text = f"{noise} {secret}"
    assert _changes(Redactor([]), text)
    assert Redactor([]).needs(encode_record(_record(text)))


@pytest.mark.parametrize("secret", SECRETS)
def test_the_check_sees_a_secret_whatever_records_came_before(secret: str) -> None:
    # the check looks for a literal through the byte of it that was rarest in the records it
    # saw: records full of each byte, then digits and punctuation between the words (which
    # the check sets aside), move that choice around; the secret is seen all the same
    redactor = Redactor([])
    for byte in sorted(set("".join(SECRETS).lower() + "".join(SECRETS))):
        assert not redactor.needs(encode_record(_record(f"{byte} 1," * 300)))
        assert redactor.needs(encode_record(_record(f"{byte} 1," * 300 + f" {secret}")))
    assert redactor.needs(encode_record(_record(f'[1,2,"{secret}",{{"a":3}}]')))


def test_the_check_sees_every_literal_of_every_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each literal the check looks for (one search may stand for several: tracer/redact.py
    ``_gates``) is seen alone in a record, as written and, where the rule ignores case, in
    capitals; and a secret environment value sharing its first bytes with another."""
    from tracer.redact import _AS_WRITTEN, BUILTIN_PATTERNS

    monkeypatch.setenv("A_TOKEN", "ghp_not_a_real_token_value")
    monkeypatch.setenv("B_TOKEN", "ghp_another_value_entirely")
    redactor = Redactor([])
    for name, (literals, _rx) in BUILTIN_PATTERNS.items():
        # a case-sensitive rule is looked for as written; the others in any case
        spellings = _AS_WRITTEN.get(name) or [v for lit in literals for v in (lit, lit.upper())]
        for text in spellings:
            assert redactor.needs(encode_record(_record(f"x {text} y"))), (name, text)
    for value in ("ghp_not_a_real_token_value", "ghp_another_value_entirely"):
        assert redactor.needs(encode_record(_record(f"the value {value} leaked")))


def test_clean_records_skip_the_per_field_pass() -> None:
    assert not Redactor([]).needs(encode_record(_record("What is 6*7? The answer is 42.")))
    assert Redactor([r"secret-\d+"]).needs(b"{}")  # user patterns always take the long way


class _Bytes(Exporter):
    """Records what the pipeline hands a byte-oriented backend; its first call waits so that
    the spool file can be read before it is deleted."""

    name = "bytes_spy"
    got: list[bytes] = []
    gate = threading.Event()
    entered = threading.Event()

    def __init__(self, config: Any = None) -> None:
        pass

    def export(self, batch: Any, *, replay: bool = False) -> ExportResult:
        raise AssertionError("the pipeline had the lines: export_encoded must be used")

    def export_encoded(self, batch: Any, lines: Any, *, replay: bool = False) -> ExportResult:
        _Bytes.entered.set()
        _Bytes.gate.wait(30)
        _Bytes.got.extend(lines)
        return ExportResult.SUCCESS


def test_byte_backends_get_the_spools_bytes(tmp_path: Path) -> None:
    register_backend("bytes_spy", _Bytes)
    _Bytes.got, _ = [], _Bytes.gate.clear()
    tracer.init(backend="bytes_spy", spool_dir=str(tmp_path / "spool"), flush_interval_s=0.05)
    try:
        for i in range(5):
            with tracer.trace_attr(step=0, sample_index=i, rollout_n=0):
                pass
        assert _Bytes.entered.wait(30)
        spooled = [p.read_bytes() for p in (tmp_path / "spool").rglob("*.jsonl")]
        _Bytes.gate.set()
        assert tracer.flush(30)
    finally:
        _Bytes.gate.set()
        tracer.reset()
    assert b"".join(spooled).splitlines() == _Bytes.got


class _Letters:
    """A tokenizer: id i decodes to one letter."""

    def __len__(self) -> int:
        return 1000

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def _finished_trajectories(tmp_path: Path) -> list[Any]:
    """Trajectories as the pipeline takes them from its buffer (nothing processed yet)."""

    @tracer.trace_op(kind="generate")
    def generate(messages: list[dict[str, str]], prompt_ids: list[int]) -> dict[str, Any]:
        return {"text": "ok", "response_ids": [7, 8, 9], "finish_reason": "stop"}

    @tracer.trace_op(kind="generate")
    def sample(prompt: str) -> dict[str, Any]:  # log-probs, no token ids
        return {"text": "ok", "logprobs": [-0.5, -0.25]}

    @tracer.trace_op(kind="tool")
    def tool(name: str, args: dict[str, Any]) -> dict[str, Any]:
        return {"result": "42", "rows": [1, 2, 3]}

    tracer.init(backend="jsonl", jsonl_path=str(tmp_path / "t.jsonl"), flush_interval_s=3600.0,
                spool_dir=str(tmp_path / "spool"), export_batch_size=10**6,
                token2text=True)  # fmt: skip
    tracer.register_tokenizer(_Letters())
    for i in range(3):
        with tracer.trace_attr(step=0, sample_index=i, rollout_n=0):
            generate([{"role": "user", "content": "hi"}], [1, 2, 3])
            sample("hi")
            tool("calculator", {"expression": "6*7"})
    pipeline = tracer.get_tracer().pipeline
    assert pipeline is not None
    trajectories = [traj for _seq, traj in pipeline.buffer]
    pipeline.buffer.clear()
    return trajectories


def test_the_line_is_the_records_json_with_the_hot_paths_bytes_in_it(tmp_path: Path) -> None:
    from tracer.record_builder import build_record

    try:
        trajectories = _finished_trajectories(tmp_path)
        config = tracer.get_tracer().config
        for traj in trajectories:
            record = build_record(traj, config, _Letters())
            assert any(type(v) is Json for s in record.spans if isinstance(s.inputs, dict)
                       for v in s.inputs.values())  # fmt: skip
            line = encode_record(record)
            assert line == encode(record.to_dict())  # the dataclasses as their dicts would be
            # the long way: every value decoded, then encoded again
            assert orjson.loads(line) == orjson.loads(encode_record(record.materialize()))
            assert not any(type(v) is Json for s in record.spans if isinstance(s.inputs, dict)
                           for v in s.inputs.values())  # fmt: skip
            # token2text and the log-prob marker went into the outputs after rendering
            assert b'"response_text":"hij"' in line and b'"prompt_text":"bcd"' in line
            assert b"log-probs: float32 base64" in line
            # a value replaced after building (redaction does that) is encoded anew
            record.spans[-1].outputs = {"result": "[REDACTED]"}
            assert b"[REDACTED]" in encode_record(record)
    finally:
        tracer.reset()


def test_the_builder_fills_each_field_with_its_own_value(tmp_path: Path) -> None:
    """The builder passes the records' fields by position: each lands where it belongs."""
    from tracer.record_builder import build_record

    try:
        traj = _finished_trajectories(tmp_path)[1]
        record = build_record(traj, tracer.get_tracer().config, _Letters())
    finally:
        tracer.reset()
    assert (record.step, record.sample_index, record.rollout_n, record.attempt) == (0, 1, 0, 0)
    assert record.name == "trajectory" and record.status == "OK" and not record.validate
    assert record.trace_id == traj.trace_id and len(record.trace_id) == 32
    assert record.project_name == "rollout-tracer" and record.experiment_name == "default"
    assert record.worker_id == tracer.get_tracer().config.worker_id
    assert record.start_ns == traj.start_ns < record.end_ns == traj.end_ns
    root, generate, _sample, tool = record.spans
    assert (root.name, root.kind, root.parent_id) == ("trajectory", "trajectory", None)
    assert [s.name for s in record.spans[1:]] == ["generate", "sample", "tool"]
    assert [s.kind for s in record.spans[1:]] == ["generate", "generate", "tool"]
    for span, raw in zip(record.spans[1:], traj.spans, strict=True):
        assert span.span_id == f"{raw.span_id:016x}" and span.parent_id == root.span_id
        assert (span.start_ns, span.end_ns) == (raw.start_ns, raw.end_ns)
        assert span.status == "OK" and span.error is None
    assert plain(tool.inputs) == {"name": "calculator", "args": {"expression": "6*7"}}
    assert plain(tool.outputs) == {"result": "42", "rows": [1, 2, 3]}
    assert tool.attributes["tool_name"] == "calculator"
    assert generate.attributes["finish_reason"] == "stop"


def test_a_record_orjson_refuses_is_written_by_the_fallback() -> None:
    span = SpanRecord("0" * 16, None, "trajectory", "trajectory", 1, 2,
                      attributes={"big": 2**70, "ok": Json(b"[1,2]")})  # fmt: skip
    record = TrajectoryRecord("a" * 32, "trajectory", "p", "e", 0, 0, 0, False, "w", 1, 2,
                              spans=[span])  # fmt: skip
    line = encode_record(record)  # orjson takes ints up to 64 bits: the json module writes it
    assert line == encode(record.to_dict())
    assert orjson.loads(line)["spans"][0]["attributes"] == {"big": 2**70, "ok": [1, 2]}


# Lines json reads that orjson refuses, reads otherwise, or reads the same: a record's line is
# read by json.loads' rules whichever parser reads it
TRICKY_LINES = [
    b'{"a": NaN, "b": Infinity, "c": -Infinity}',
    b"[1e400, -1e400]",
    b"[1180591620717411303425, -9223372036854775809, 18446744073709551616]",
    b"[9223372036854775807, -9223372036854775808, 18446744073709551615, 1796535734698384624]",
    b'["\\ud800", "\\udfff x"]',
    '{"k\u00e9y": "\u00fcnicode \u2028 \U0001f600", "\u65e5": ["\\u00e9"]}'.encode(),
    b'{"n": {"m": [{"o": [1, 2.5, -0, -0.0, 1E5, 1e-05, 0.1]}]}, "n": 2}',
    b'{"digits": "123456789012345678901234567890", "id": "-1234567890123456789"}',
    b"[1.00000000000000000000000000001, 123456789012345678901234567890.5]",
    b'  {"a": [true, false, null, ""]}  ',
]


@pytest.mark.parametrize("line", TRICKY_LINES)
def test_a_line_reads_as_json_reads_it(line: bytes) -> None:
    from tracer.encode import decode

    # repr: an int is not a float of the same value, nan is nan
    assert repr(decode(line)) == repr(json.loads(line))


def test_the_export_child_reads_a_fallback_line_as_it_was_written() -> None:
    """A record orjson cannot write (an int past 64 bits) is written by json, NaN and all: the
    export child reads it back with its exact int and its NaN, as json does."""
    from tracer.backends.export_process import _record

    attributes = {"big": 2**70 + 1, "nan": float("nan"), "neg": -(2**63) - 1}
    span = SpanRecord("0" * 16, None, "trajectory", "trajectory", 1, 2, attributes=attributes)
    record = TrajectoryRecord("a" * 32, "trajectory", "p", "e", 0, 0, 0, False, "w", 1, 2,
                              spans=[span])  # fmt: skip
    line = encode_record(record)
    assert b"NaN" in line
    attributes = _record(line).spans[0].attributes
    assert attributes["big"] == 2**70 + 1 and type(attributes["big"]) is int
    assert attributes["neg"] == -(2**63) - 1 and type(attributes["neg"]) is int
    assert attributes["nan"] != attributes["nan"]


def _holds_fragments(x: Any) -> bool:
    if type(x) is Json:
        return True
    if isinstance(x, dict):
        return any(_holds_fragments(v) for v in x.values())
    if isinstance(x, list):
        return any(_holds_fragments(v) for v in x)
    return False


def test_backends_and_keep_rules_that_read_values_get_them_decoded(tmp_path: Path) -> None:
    """The memory backend (Python values) and a keep predicate see plain lists and dicts;
    the JSONL line, written from the hot path's bytes, holds the same data."""
    from tracer.testing import InMemoryExporter

    seen: list[Any] = []

    def predicate(record: TrajectoryRecord) -> bool:
        seen.extend(s.inputs for s in record.spans)
        return True

    @tracer.trace_op(kind="generate")
    def generate(messages: list[dict[str, str]], prompt_ids: list[int]) -> dict[str, Any]:
        return {"text": "ok", "response_ids": [7, 8, 9], "finish_reason": "stop"}

    messages, ids = [{"role": "user", "content": "hi"}], [1, 2, 3]
    path = tmp_path / "t.jsonl"
    tracer.init(backend=["memory", "jsonl"], jsonl_path=str(path), spool_dir=str(tmp_path / "s"),
                keep=["predicate"], keep_predicate=predicate,
                max_samples_per_step_per_worker=0)  # fmt: skip
    try:
        with tracer.trace_attr(step=0, sample_index=0, rollout_n=0):
            generate(messages, ids)
        assert tracer.flush(30)
        [record] = InMemoryExporter.latest().records
        span = record.spans[1]
        assert span.inputs == {"messages": messages, "prompt_ids": ids}
        assert span.outputs["response_ids"] == [7, 8, 9]
        assert not any(_holds_fragments(s.inputs) or _holds_fragments(s.outputs)
                       for s in record.spans)  # fmt: skip
        assert seen and not any(_holds_fragments(x) for x in seen)
        line = orjson.loads(path.read_bytes())
        assert line["spans"][1]["inputs"] == span.inputs
        assert line["spans"][1]["outputs"] == span.outputs
    finally:
        tracer.reset()


def test_the_per_field_pass_decodes_only_the_json_that_holds_a_secret() -> None:
    args, _ = snapshot_args(("messages", "prompt_ids"), (
        [{"role": "user", "content": "my key is sk-abcdefghijklmnopqrstuvwx"}],
        list(range(1000))), {}, 20_000, 200_000)  # fmt: skip
    assert all(type(v) is Json for v in args.values())
    out = Redactor([]).value(args)
    assert out["messages"] == [{"role": "user", "content": "my key is [REDACTED]"}]
    assert out["prompt_ids"] is args["prompt_ids"]  # nothing to change: its bytes stay


def test_a_records_line_holds_every_field_in_order() -> None:
    # encode_record writes the fields out by name (tracer/encode.py says why): a field added
    # to the record or a span shows here
    record = _record("some text")
    record.spans[0].error = {"type": "ValueError", "message": "m", "traceback": "t"}
    assert encode_record(record) == encode(record.to_dict())
    assert list(json.loads(encode_record(record))) == [
        f.name for f in dataclasses.fields(TrajectoryRecord)]
    assert list(json.loads(encode_record(record))["spans"][0]) == [
        f.name for f in dataclasses.fields(SpanRecord)]


def test_encoding_a_record_leaves_it_no_instance_dicts() -> None:
    # orjson would read each dataclass through a __dict__ the instance then keeps: objects
    # for the garbage collector while the record waits for export
    import gc

    records = [_record(f"text {i}") for i in range(50)]
    before = sum(type(o) is dict for o in gc.get_objects())
    lines = [encode_record(r) for r in records]
    assert sum(type(o) is dict for o in gc.get_objects()) - before < len(records)
    assert lines[0] == encode(records[0].to_dict())


def test_a_snapshot_of_a_dict_holding_lists_is_not_tracked_by_the_collector() -> None:
    """The hot path's copy of a generate's outputs (token ids in a list) holds the ids as JSON:
    nothing the garbage collector needs to walk, so the copy is not tracked, and thousands of
    them waiting for export do not bring the next full collection closer."""
    import gc

    outputs = {"response_ids": list(range(64)), "finish_reason": "stop", "turn": 0}
    shown, _ = snapshot(outputs, 1000)
    assert type(shown["response_ids"]) is Json and shown["finish_reason"] == "stop"
    assert not gc.is_tracked(shown)
    assert gc.is_tracked(outputs)  # the caller's dict is the caller's
