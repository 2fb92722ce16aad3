"""Tools the agent can call: a safe calculator, a Python runner, local retrieval.

The Python runner's isolation (what the code can and cannot reach) is described in
:mod:`rollout.code_runner`.

Every failure (unknown tool, bad arguments, timeout, crash) becomes a :class:`ToolResult` with
``error`` set; :meth:`ToolRegistry.call` never raises.
"""

from __future__ import annotations

import ast
import asyncio
import json
import math
import operator
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from rollout.code_runner import (
    ISOLATION_MODES,
    RunTimeout,
    resolve_isolation,
    run_python,
    signal_of,
)
from tracer import set_span_attributes, trace_op


class ToolError(Exception):
    """A tool rejected its input or failed; the message goes back to the model."""


@dataclass
class ToolResult:
    """The outcome of one tool call; ``content`` is what the model sees."""

    name: str
    content: str
    error: str | None = None
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        """True when the tool ran without error."""
        return self.error is None


class Tool:
    """Base class: a name, an OpenAI-style JSON schema, and an async ``execute``."""

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {}

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool schema passed to the chat template."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}

    def validate(self, arguments: dict[str, Any]) -> None:
        """Check required keys, unknown keys and basic JSON types; raise :class:`ToolError`."""
        props: dict[str, Any] = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            raise ToolError(f"missing required argument(s): {', '.join(missing)}")
        unknown = [k for k in arguments if k not in props]
        if unknown:
            raise ToolError(f"unknown argument(s): {', '.join(unknown)}; valid: {', '.join(props)}")
        types: dict[str, type | tuple[type, ...]] = {
            "string": str, "integer": int, "number": (int, float), "boolean": bool,
        }  # fmt: skip
        for key, value in arguments.items():
            want = types.get(props[key].get("type", ""))
            if want is not None and (
                not isinstance(value, want) or (isinstance(value, bool) and want is not bool)
            ):
                raise ToolError(f"argument {key!r} must be of type {props[key]['type']}")

    async def execute(self, **arguments: Any) -> str:
        """Run the tool; return the text the model sees."""
        raise NotImplementedError


# --------------------------------------------------------------------------- calculator
_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}  # fmt: skip
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS: dict[str, Callable[..., Any]] = {
    "abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt,
    "floor": math.floor, "ceil": math.ceil,
}  # fmt: skip
_MAX_ABS = 10**100
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_MAX_EXPONENT = 1000


def safe_eval(expression: str) -> int | float:
    """Evaluate an arithmetic expression by walking its AST (no ``eval``).

    Allows numbers, ``+ - * / // % **``, parentheses, unary signs and a few functions
    (abs, round, min, max, sqrt, floor, ceil). Exponents and magnitudes are bounded.
    """
    if len(expression) > 500:
        raise ToolError("expression too long (max 500 characters)")
    try:
        text = _THOUSANDS.sub("", expression.replace("^", "**"))  # "1,234" -> "1234"
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"invalid expression: {exc.msg}") from None

    def walk(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value  # type: ignore[return-value]
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and (
                abs(right) > _MAX_EXPONENT
                or (abs(left) > 1 and abs(right) * math.log10(abs(left)) > 100)
            ):
                raise ToolError("exponent too large")
            try:
                value = _BINOPS[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            if isinstance(value, complex):
                raise ToolError("complex result")
            if abs(value) > _MAX_ABS:
                raise ToolError("result too large")
            return value
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCS
            and not node.keywords
            and len(node.args) <= 8
        ):
            try:
                return _FUNCS[node.func.id](*[walk(a) for a in node.args])
            except (ValueError, TypeError) as exc:
                raise ToolError(f"{node.func.id}: {exc}") from None
        raise ToolError(f"unsupported syntax: {type(node).__name__}")

    return walk(tree)


class Calculator(Tool):
    """Arithmetic on numbers; safe (AST-walking, bounded)."""

    name = "calculator"
    description = "Evaluate an arithmetic expression, e.g. '(12 + 30) * 3 / 2'."
    parameters = {
        "type": "object",
        "properties": {
            "expression": {
                "type": "string",
                "description": "arithmetic only",
                # numbers, operators, parentheses: structured decoding (tool_choice=required)
                # keeps a small model's argument arithmetic instead of prose
                "pattern": r"^[0-9(][0-9+\-*/(). ]{0,47}$",
            }
        },
        "required": ["expression"],
    }

    async def execute(self, **arguments: Any) -> str:
        """Return the value of ``expression`` (integers without a trailing ``.0``)."""
        value = safe_eval(arguments["expression"])
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
            value = int(value)
        return str(value)


# --------------------------------------------------------------------------- python runner
class PythonRunner(Tool):
    """Runs a Python snippet in a separate interpreter with CPU, memory, file-size and time
    limits; on timeout every process it started is killed (rollout/code_runner.py, Linux only).

    ``isolation``: ``"auto"`` (default) hides the host's files and network with bubblewrap
    where ``bwrap`` works, and runs without that isolation (one warning) where it does not;
    ``"bwrap"`` requires it (ValueError at the first call otherwise); ``"none"`` never uses it.
    ``writable_dir``: a folder the code may write to (its working directory).
    """

    name = "python"
    description = "Run a short Python 3 program and return what it prints (stdout)."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source"}},
        "required": ["code"],
    }

    def __init__(
        self,
        timeout_s: float = 5.0,
        memory_mb: int = 256,
        max_output_chars: int = 2000,
        isolation: str = "auto",
        writable_dir: str | None = None,
    ) -> None:
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"isolation must be one of {', '.join(ISOLATION_MODES)}, got "
                             f"{isolation!r}")  # fmt: skip
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_output_chars = max_output_chars
        self.isolation = isolation
        self.writable_dir = writable_dir

    def limits(self) -> tuple[int, int, int, int]:
        """(RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_CORE) of the code and its children."""
        return self.memory_mb * 1024 * 1024, math.ceil(self.timeout_s) + 1, 1 << 20, 0

    async def execute(self, **arguments: Any) -> str:
        """Run ``code``; return stdout, or raise :class:`ToolError` on error/timeout."""
        code: str = arguments["code"]
        if len(code) > 20_000:
            raise ToolError("code too long (max 20000 characters)")
        try:
            bwrap = resolve_isolation(self.isolation)
            done = await run_python(code, limits=self.limits(), timeout_s=self.timeout_s,
                                    bwrap=bwrap, writable_dir=self.writable_dir,
                                    max_output_bytes=4 * self.max_output_chars + 4096)  # fmt: skip
        except RunTimeout as exc:
            raise ToolError(str(exc)) from None
        stdout = done.stdout.decode("utf-8", "replace")[: self.max_output_chars]
        if done.returncode != 0:
            sig = signal_of(done.returncode)
            lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
            last = lines[-1] if lines else f"killed by signal {sig}"
            if sig in (signal.SIGKILL, signal.SIGXCPU):
                last = "resource limit exceeded (CPU/memory)"
            raise ToolError(f"exit code {done.returncode}: {last[-500:]}\n{stdout}".rstrip())
        return stdout.rstrip() or "(no output)"


# --------------------------------------------------------------------------- retrieval
_WORD = re.compile(r"[a-z0-9]+")


def _tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class Retriever(Tool):
    """BM25 search over the small corpus shipped in ``rollout/data/corpus.jsonl``."""

    name = "search"
    description = "Search a small reference corpus (units, conversions, math facts)."
    parameters = {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "top_k": {"type": "integer", "description": "results to return (1-5)"},
        },
        "required": ["query"],
    }

    def __init__(self, docs: list[dict[str, str]] | None = None, k1=1.5, b=0.75) -> None:
        if docs is None:
            text = resources.files("rollout").joinpath("data/corpus.jsonl").read_text("utf-8")
            docs = [json.loads(line) for line in text.splitlines() if line.strip()]
        self.docs = docs
        self._tf = [Counter(_tokens(d["title"] + " " + d["text"])) for d in docs]
        self._len = [sum(tf.values()) for tf in self._tf]
        self._avg = sum(self._len) / max(1, len(self._len))
        df: Counter[str] = Counter(t for tf in self._tf for t in tf)
        n = len(docs)
        self._idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}
        self.k1, self.b = k1, b

    def search(self, query: str, top_k: int = 2) -> list[tuple[float, dict[str, str]]]:
        """Return the ``top_k`` best (score, doc) pairs with a positive score."""
        q = _tokens(query)
        scored = []
        for tf, length, doc in zip(self._tf, self._len, self.docs, strict=True):
            s = sum(
                self._idf[t] * tf[t] * (self.k1 + 1)
                / (tf[t] + self.k1 * (1 - self.b + self.b * length / self._avg))
                for t in q if t in tf
            )  # fmt: skip
            if s > 0:
                scored.append((s, doc))
        scored.sort(key=lambda x: -x[0])
        return scored[:top_k]

    async def execute(self, **arguments: Any) -> str:
        """Return the best matching passages, one per line."""
        top_k = arguments.get("top_k", 2)
        if not 1 <= top_k <= 5:
            raise ToolError("top_k must be between 1 and 5")
        hits = self.search(arguments["query"], top_k)
        if not hits:
            return "No results."
        return "\n".join(f"[{d['title']}] {d['text']}" for _, d in hits)


# --------------------------------------------------------------------------- registry
class ToolRegistry:
    """The tools available to the agent, by name; executes calls safely."""

    def __init__(self, tools: list[Tool], timeout_s: float = 10.0) -> None:
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s

    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI tool schemas for the chat template."""
        return [t.schema() for t in self.tools.values()]

    @trace_op(kind="tool", name="call_tool")
    async def call(
        self, name: str, arguments: dict[str, Any], parse_error: str | None = None
    ) -> ToolResult:
        """Run tool ``name`` with ``arguments``; errors come back as ``ToolResult.error``.

        ``parse_error`` (set when the model's call could not be parsed) is returned as the
        error without running anything.
        """
        start = time.perf_counter()
        tool = self.tools.get(name)
        if tool is not None:  # OpenInference's tool.parameters (the OTLP backend)
            set_span_attributes(tool_schema=tool.parameters)
        try:
            if parse_error is not None:
                raise ToolError(parse_error)
            if tool is None:
                raise ToolError(f"unknown tool {name!r}; available: {', '.join(self.tools)}")
            if not isinstance(arguments, dict):
                raise ToolError("arguments must be a JSON object")
            tool.validate(arguments)
            content = await asyncio.wait_for(tool.execute(**arguments), self.timeout_s)
            return ToolResult(name, content, None, time.perf_counter() - start)
        except ToolError as exc:
            err = str(exc)
        except asyncio.TimeoutError:
            err = f"timed out after {self.timeout_s:g} s"
        except Exception as exc:  # a crashing tool must not crash the rollout
            err = f"{type(exc).__name__}: {exc}"
        return ToolResult(name, f"Error: {err}", err, time.perf_counter() - start)


def default_tools(names: list[str] | None = None) -> ToolRegistry:
    """A registry with the builtin tools (``calculator``, ``python``, ``search``) or a subset."""
    builtin: dict[str, type[Tool]] = {"calculator": Calculator, "python": PythonRunner,
                                      "search": Retriever}  # fmt: skip
    names = list(builtin) if names is None else names
    bad = [n for n in names if n not in builtin]
    if bad:
        raise ValueError(f"unknown tool(s) {bad}; valid: {', '.join(builtin)}")
    return ToolRegistry([builtin[n]() for n in names])
