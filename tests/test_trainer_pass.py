"""The trainer pass's log-probs and entropy, against a plain forward pass over every position
(the pass sends only the response positions through the LM head)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rollout.models import load_model  # noqa: E402
from rollout.trainer_pass import forward  # noqa: E402


def test_forward_matches_a_full_forward_pass() -> None:
    model, _ = load_model("tiny-qwen3", dtype="float32")
    prompt, response = list(range(5, 45)), list(range(50, 62))
    lps, ent = forward(model, prompt, response)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    want = logp.gather(-1, torch.tensor(response).unsqueeze(-1))[:, 0].tolist()
    assert lps == pytest.approx(want, abs=1e-5) and len(lps) == len(response)
    assert ent == pytest.approx((-(logp.exp() * logp).sum(-1)).tolist(), abs=1e-5)
