"""Per-token values: their compact encoding and the KL estimators derived from them. A leaf:
writers (the record builder, the annotator) and readers (the ``tokens`` table, the report)
share it, and it imports nothing of the tracer.

Encoding
    A per-token array is stored as one string ``"f32:" + base64(little-endian float32)``:
    4 bytes a token (5.3 characters once in base64; 1,000 log-probs are 5,336 characters
    instead of ~20,000 as a JSON list), exact to float32 (about 7 significant digits), and one
    line in MLflow's span view instead of a thousand. A missing value (NaN) stays NaN.

KL estimators (Schulman, "Approximating KL divergence"), per token, with ``logr`` the log of
the ratio of the other policy over the sampling one at the sampled token:
    k1 = -logr                 unbiased, can be negative per token
    k3 = exp(logr) - 1 - logr  unbiased, never negative, lower variance (verl's ``low_var_kl``)

    mismatch KL  KL(rollout || trainer), tokens sampled by the rollout engine:
                 logr = train_logprob - rollout_logprob
    ref KL       KL(trainer || reference), as verl's KL penalty: logr = ref_logprob - train_logprob

The ``mismatch_kl`` and ``ref_kl`` columns and the heatmap use k3; ``*_k1`` columns carry k1.
"""

from __future__ import annotations

import array
import base64
import math
import sys
from collections.abc import Iterable, Sequence
from typing import Any

PREFIX = "f32:"

# Values a trajectory can carry per token (arrays aligned with its model tokens) and the name
# of the rollout engine's own log-probs on a generate span.
TOKEN_VALUES = ("rollout_logprob", "train_logprob", "ref_logprob", "entropy", "advantage")
LOGPROBS_ATTR = "rollout_tracer.logprobs"  # generate span: the engine's log-probs, encoded
VALUE_ATTR_PREFIX = "rollout_tracer.values."  # annotation span: one attribute per value
ANNOTATION_KIND = "annotation"


def encode_floats(values: Iterable[Any]) -> str:
    """``"f32:<base64>"`` of the values as little-endian float32 (None -> NaN)."""
    arr = array.array("f", (math.nan if v is None else float(v) for v in values))
    if sys.byteorder == "big":
        arr.byteswap()
    return PREFIX + base64.b64encode(arr.tobytes()).decode("ascii")


def decode_floats(text: Any) -> list[float] | None:
    """The list of floats a value encoded by :func:`encode_floats` holds; a plain list of
    numbers is returned as floats; anything else is None."""
    if isinstance(text, list):
        try:
            return [float(v) if v is not None else math.nan for v in text]
        except (TypeError, ValueError):
            return None
    if not isinstance(text, str) or not text.startswith(PREFIX):
        return None
    try:
        raw = base64.b64decode(text[len(PREFIX):], validate=True)
    except ValueError:
        return None
    arr = array.array("f")
    arr.frombytes(raw[: len(raw) - len(raw) % 4])
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tolist()


def as_float_list(values: Any) -> list[float] | None:
    """A numpy array, torch tensor, list or tuple of numbers -> a flat list of floats."""
    if values is None:
        return None
    if hasattr(values, "detach"):
        values = values.detach().float().cpu()
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()
    if isinstance(values, (list, tuple)):
        flat: list[float] = []
        for v in values:
            if isinstance(v, (list, tuple)):  # a batch of one
                flat.extend(math.nan if x is None else float(x) for x in v)
            else:
                flat.append(math.nan if v is None else float(v))
        return flat
    return None


def k1(logr: float) -> float:
    return -logr


def k3(logr: float) -> float:
    # clamped as verl's low_var_kl does, so one runaway token cannot overflow exp()
    logr = max(-20.0, min(20.0, logr))
    return math.expm1(logr) - logr


def mismatch_logr(rollout: float, train: float) -> float:
    return train - rollout


def ref_logr(train: float, ref: float) -> float:
    return ref - train


def kl_series(
    sampling: Sequence[float] | None, other: Sequence[float] | None, ref_style: bool
) -> tuple[list[float], list[float]] | None:
    """Per-token (k1, k3). ``ref_style=False``: sampling = rollout, other = train (mismatch);
    ``True``: sampling = train, other = ref. None when either is missing or lengths differ."""
    if sampling is None or other is None or len(sampling) != len(other):
        return None
    logr = [o - s for s, o in zip(sampling, other, strict=True)]
    return [k1(x) for x in logr], [k3(x) for x in logr]


def _finite(values: Iterable[float]) -> list[float]:
    return [v for v in values if isinstance(v, float) and math.isfinite(v)]


def summarize(values: dict[str, list[float]]) -> dict[str, float]:
    """Per-trajectory aggregates of per-token values (model tokens only): mean and max of
    each KL (k3; k1 mean too), min and mean rollout log-prob, mean entropy."""
    out: dict[str, float] = {}
    rollout, train, ref = (values.get(k) for k in ("rollout_logprob", "train_logprob",
                                                   "ref_logprob"))  # fmt: skip
    for name, pair in (("mismatch_kl", kl_series(rollout, train, False)),
                       ("ref_kl", kl_series(train, ref, True))):  # fmt: skip
        if pair is None:
            continue
        k1s, k3s = _finite(pair[0]), _finite(pair[1])
        if k3s:
            out[f"{name}_mean"] = sum(k3s) / len(k3s)
            out[f"{name}_max"] = max(k3s)
        if k1s:
            out[f"{name}_k1_mean"] = sum(k1s) / len(k1s)
    for name, key in (("logprob", "rollout_logprob"), ("train_logprob", "train_logprob")):
        finite = _finite(values.get(key) or [])
        if finite:
            out[f"{name}_min"] = min(finite)
            out[f"{name}_mean"] = sum(finite) / len(finite)
    entropy = _finite(values.get("entropy") or [])
    if entropy:
        out["entropy_mean"] = sum(entropy) / len(entropy)
    return out
