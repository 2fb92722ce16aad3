"""Secret formats the built-in redaction knows (docs/reliability.md#secrets), each as a real
format with a fake value, inside ordinary text and inside JSON-ish tool arguments: gone from
what the pipeline exports (the serialized-record gate and the per-field pass both see them)."""

from __future__ import annotations

import pytest

from tracer.redact import MARK, Redactor
from tracer.snapshot import json_value

_B = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
FAKE = {
    "github classic": "ghp_" + _B[:36],
    "github oauth": "gho_" + _B[10:46],
    "github app": "ghs_" + _B[20:56],
    "github fine-grained": "github_pat_11ABCDEFG0" + _B[:12] + "_" + _B[12:60],
    "gcp api key": "AIza" + "SyD-" + _B[:31],
    "slack bot": "xoxb-" + "1234567890-1234567890123-" + _B[:24],
    "slack webhook": "https://hooks.slack.com/services/T00000000/B00000000/" + _B[:24],
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0."
    + "dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "pem": "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA" + _B
    + "\n-----END RSA PRIVATE KEY-----",
    "gcp service account": "-----BEGIN PRIVATE KEY-----\\nMIIEvQIBADANBg" + _B
    + "\\n-----END PRIVATE KEY-----\\n",
    "stripe": "sk_live_" + _B[:24],
    "anthropic": "sk-ant-api03-" + _B + _B[:30],
    "openai": "sk-proj-" + _B[:40],
    "aws access key id": "AKIA" + "Z7QWERTYUIOP4ASD",
    "hf": "hf_" + _B[:34],
}


@pytest.mark.parametrize("name", sorted(FAKE))
def test_each_format_is_redacted(name: str) -> None:
    secret = FAKE[name]
    redactor = Redactor([])
    text = f"please use {secret} for the call"
    assert secret not in redactor.text(text) and MARK in redactor.text(text)
    # as the hot path takes plain data (its JSON bytes): the serialized gate must see it too
    out = redactor.value(json_value({"args": {"token": secret}, "text": text}))
    assert secret not in repr(out) and MARK in repr(out)


def test_ordinary_text_is_left_alone() -> None:
    redactor = Redactor([])
    for text in ("The answer is 42; 17 * 3 = 51, and 'eyes' are not keys.",
                 "def f(xoxo): return AIzaleas  # private key points",
                 "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]"):
        assert redactor.text(text) == text


def test_a_git_sha_and_math_are_left_alone_a_wandb_key_in_context_is_not() -> None:
    """#55: a bare run of 40 hex digits is a commit far more often than a W&B key."""
    redactor = Redactor([])
    sha = "3f1c2a9d8e7b6a5f4e3d2c1b0a9f8e7d6c5b4a39"
    for text in (f"Reverted in commit {sha}; see https://example.org/x/commit/{sha}.",
                 f"sha1 of the model file: {sha}",
                 "Let x = 2^{10} - 24 = 1000; then 1000/8 = 125 and 125 = 5^3, so k = 3.",
                 "0123456789" * 6):  # fmt: skip
        assert redactor.text(text) == text
        assert redactor.value(json_value({"text": text})) == {"text": text}
    key = "0123456789abcdef0123456789abcdef01234567"
    for text in (f"wandb login {key}", f'{{"api_key": "{key}"}}', f"WANDB_API_KEY={key}"):
        out = redactor.value(json_value({"text": text}))
        assert key not in repr(out) and MARK in repr(out), text


def test_no_rule_redacts_the_projects_own_text() -> None:
    """benchmarks/bench_redact.py's corpus (rollout data, README, docs, hex digests) has no
    secret: no rule of today changes any of it; the bare 40-hex rule of before did."""
    from benchmarks.bench_redact import corpus, false_positives

    counts = false_positives(corpus())
    before = counts.pop("wandb-key (bare 40 hex, before #55)")
    assert counts == dict.fromkeys(counts, 0) and before > 0
