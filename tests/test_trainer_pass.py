"""The trainer pass's log-probs and entropy, against a plain forward pass over every position
(the pass sends only the response positions through the LM head)."""

from __future__ import annotations

import copy

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


def test_bf16_matmuls_in_float32_compute_what_a_bf16_gemm_does() -> None:
    from rollout.trainer_pass import bf16_matmuls_in_float32

    gen = torch.Generator().manual_seed(0)  # a local generator: the global seed is the user's
    layer = torch.nn.Linear(64, 32).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(32, 64, generator=gen))
        layer.bias.copy_(torch.randn(32, generator=gen))
    other = torch.nn.Linear(64, 32).to(torch.bfloat16)
    model = torch.nn.Sequential(layer)
    x = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
    bf16_matmuls_in_float32(model)
    got = model(x)
    # bfloat16 in, exact products and sums (float64 here), one rounding to bfloat16 at the end
    exact = (x.double() @ layer.weight.double().T + layer.bias.double()).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    ulp = (exact.float().abs() * 2**-7).clamp(min=1e-6)  # one bfloat16 step at that size
    assert bool(((got.float() - exact.float()).abs() <= ulp).all())
    assert "forward" not in vars(other)  # only the model it was given changes


def test_the_trainer_pass_bf16_gap_is_the_native_kernels_size() -> None:
    """The emulated pass differs from float32 by as much as PyTorch's own bfloat16 kernel does
    (bfloat16 rounding, not an error of the emulation)."""
    from rollout.trainer_pass import bf16_matmuls_in_float32

    prompt, response = list(range(5, 45)), list(range(50, 62))
    f32, _ = load_model("tiny-qwen3", dtype="float32")
    ref, _ = forward(f32, prompt, response)
    native, _ = forward(copy.deepcopy(f32).to(torch.bfloat16), prompt, response)
    model = copy.deepcopy(f32).to(torch.bfloat16)
    bf16_matmuls_in_float32(model)
    emulated, _ = forward(model, prompt, response)

    def gap(a: list[float]) -> float:
        return sum(abs(u - v) for u, v in zip(a, ref, strict=True)) / len(ref)

    # bfloat16 (not float32), and no further from float32 than the native kernel
    assert 0 < gap(emulated) <= 3 * gap(native), (gap(emulated), gap(native))


def test_the_pass_runs_on_the_engines_thread_count_and_gives_the_old_one_back() -> None:
    """``rollout.num_threads`` holds for the trainer pass too (torch's default, every core,
    spun for cores a busy machine does not have: 21 % slower beside a busy process), and the
    caller's setting is as it was afterwards."""
    from types import SimpleNamespace

    from rollout.trainer_pass import TrainerPass

    model, _ = load_model("tiny-qwen3", dtype="float32")
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2  # a count that differs from the caller's
    seen: list[int] = []
    model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    out = SimpleNamespace(prompt_ids=list(range(5, 25)), response_ids=list(range(50, 56)),
                          response_mask=[1] * 6, response_logprobs=[-1.0] * 6,
                          extra={"step": 0, "sample_index": 0, "rollout_n": 0})  # fmt: skip
    metrics, tokens = TrainerPass(model, model, num_threads=wanted).run(
        SimpleNamespace(step=0, outputs=[out]))  # fmt: skip
    assert seen == [wanted, wanted]  # the trainer's pass and the reference's
    assert torch.get_num_threads() == before
    assert len(tokens.train[0]) == 6 and metrics
