"""`train.optimizer`: adamw_bf16's update by hand and against torch's AdamW, its stochastic rounding, exact resume
of every optimiser through the engine's checkpoint files, and the messages for what cannot run."""

from __future__ import annotations

import importlib.util
import io
import json
import math

import pytest
import torch
from conftest import oxrl, read_metrics
from test_config_errors import assert_user_error

from oxrl_core.engines import check_optimizer
from oxrl_core.engines.optimizers import AdamWBf16, round_to_bf16, state_bytes
from oxrl_core.errors import OxrlError

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def test_stochastic_rounding_is_exact_on_bf16_values_and_unbiased_between_them():
    generator = torch.Generator().manual_seed(0)
    exact = torch.tensor([1.0, -2.5, 0.0, 1.25, 3.0e-3]).bfloat16().float()  # already bf16 values: kept as they are
    assert torch.equal(round_to_bf16(exact, generator).float(), exact)
    # 1 + 2⁻⁹ lies a quarter of the way from 1 to the next bf16 value 1 + 2⁻⁷: rounded up 1 time in 4
    x = torch.full((200_000,), 1 + 2**-9)
    rounded = round_to_bf16(x, generator).float()
    assert set(rounded.unique().tolist()) == {1.0, 1 + 2**-7}
    assert abs((rounded > 1).float().mean().item() - 0.25) < 0.005
    assert abs(rounded.double().mean().item() - (1 + 2**-9)) < 2e-5  # unbiased (nearest would give 1.0 always)
    negative = round_to_bf16(-x, generator).float()  # the same on the magnitude of a negative number
    assert abs((negative < -1).float().mean().item() - 0.25) < 0.005


def test_two_steps_by_hand_equal_torch_adamw():
    # β₁ = 0.5, β₂ = 0.75, ε = 0, lr = 0.1, λ = 0.5: every moment below is a bf16 value, so rounding changes nothing
    theta = torch.nn.Parameter(torch.tensor([1.0]))
    reference = torch.nn.Parameter(torch.tensor([1.0]))
    kwargs = {"lr": 0.1, "betas": (0.5, 0.75), "eps": 0.0, "weight_decay": 0.5}
    ours, torchs = AdamWBf16([theta], **kwargs), torch.optim.AdamW([reference], **kwargs)
    # step 1, g = 1: θ ← 1 · (1 − 0.1·0.5) = 0.95; m = 0.5·0 + 0.5·1 = 0.5; v = 0.75·0 + 0.25·1 = 0.25;
    # m̂ = 0.5 / (1 − 0.5) = 1, v̂ = 0.25 / (1 − 0.75) = 1; θ ← 0.95 − 0.1 · 1 / √1 = 0.85
    # step 2, g = 2: θ ← 0.85 · 0.95 = 0.8075; m = 0.25 + 1 = 1.25; v = 0.1875 + 0.25·4 = 1.1875;
    # m̂ = 1.25 / (1 − 0.25) = 5/3, v̂ = 1.1875 / (1 − 0.5625) = 19/7; θ ← 0.8075 − 0.1 · (5/3) / √(19/7)
    expected = [0.85, 0.8075 - 0.1 * (5 / 3) / math.sqrt(19 / 7)]  # 0.85, 0.706338...
    for g, want in zip([1.0, 2.0], expected):
        theta.grad, reference.grad = torch.tensor([g]), torch.tensor([g])
        ours.step()
        torchs.step()
        assert theta.item() == pytest.approx(want, abs=1e-7)
        assert theta.item() == pytest.approx(reference.item(), abs=1e-7)
    state = ours.state[theta]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert (state["exp_avg"].item(), state["exp_avg_sq"].item(), state["step"].item()) == (1.25, 1.1875, 2.0)


def test_thirty_steps_follow_torch_adamw_within_bf16_tolerance_at_half_the_state():
    torch.manual_seed(0)
    start = torch.randn(4096)
    theta, reference = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    ours = AdamWBf16([theta], lr=1e-2, weight_decay=0.1)
    torchs = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.1)
    for step in range(30):
        g = torch.randn(4096) + 0.5
        theta.grad, reference.grad = g.clone(), g.clone()
        ours.step()
        torchs.step()
        if step == 0:  # the first update reads the fp32 moments before they are stored: torch's, exactly
            assert torch.equal(theta, reference)
    moved = (reference - start).norm()
    assert (theta - reference).norm() < 1e-2 * moved  # bf16 keeps 8 significant bits: about 0.4% per value
    assert state_bytes(ours) == 2 * 2 * 4096 + 4 and state_bytes(torchs) == 2 * 4 * 4096 + 4  # moments + step


def test_the_stored_second_moment_decays_instead_of_stalling():
    """After one gradient of 1, v = 0.001; with zero gradients v ← 0.999·v. Rounded to nearest, a bf16 v could
    never move (a 0.1% change is below half its spacing); stochastically rounded, it decays as fp32's does."""
    theta = torch.nn.Parameter(torch.zeros(20_000))
    optimizer = AdamWBf16([theta], lr=1e-3, weight_decay=0.0)
    theta.grad = torch.ones(20_000)
    optimizer.step()
    # m = 0.1 is no bf16 value: m is stored rounded to nearest (0.10009765625 everywhere), v stochastically
    assert torch.equal(optimizer.state[theta]["exp_avg"], torch.full((20_000,), 0.1).bfloat16())
    assert optimizer.state[theta]["exp_avg_sq"].unique().numel() == 2  # 0.001 lies between two bf16 values
    theta.grad = torch.zeros(20_000)
    for _ in range(300):
        optimizer.step()
    v = optimizer.state[theta]["exp_avg_sq"].float().mean().item()
    assert v == pytest.approx(0.001 * 0.999**300, rel=0.02)  # 0.000741
    nearest = torch.tensor(0.001).bfloat16()
    for _ in range(300):
        nearest = (nearest.float() * 0.999).bfloat16()
    assert nearest.item() == torch.tensor(0.001).bfloat16().item()  # what round-to-nearest would have kept


def test_a_state_dict_resumes_exactly_with_its_bf16_states_and_rounding_draws():
    torch.manual_seed(1)
    grads = [torch.randn(3000) for _ in range(6)]
    theta = torch.nn.Parameter(torch.randn(3000))
    optimizer = AdamWBf16([theta], lr=1e-2, seed=5)
    for g in grads[:3]:
        theta.grad = g.clone()
        optimizer.step()
    buffer = io.BytesIO()
    torch.save({"theta": theta.detach().clone(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed = torch.nn.Parameter(saved["theta"])
    again = AdamWBf16([resumed], lr=1e-2, seed=5)
    again.load_state_dict(saved["optimizer"])
    assert again.state[resumed]["exp_avg_sq"].dtype == torch.bfloat16  # torch's loader casts to fp32; cast back
    for g in grads[3:]:
        theta.grad, resumed.grad = g.clone(), g.clone()
        optimizer.step()
        again.step()
    assert torch.equal(theta, resumed)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(optimizer.state[theta][key], again.state[resumed][key])


def _engine(optimizer: str, model_state=None):
    """A torch engine over a small Llama (its embedding 64 × 64 = 4,096 values: torchao quantises it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from oxrl_core.config import load_run_config
    from oxrl_core.engines.torch_engine import TorchEngine

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config)
    if model_state is not None:
        model.load_state_dict(model_state)
    overrides = ["train.lr=1e-2", "train.weight_decay=0.1", f"train.optimizer={optimizer}", "engine.device=cpu"]
    cfg = load_run_config(overrides=overrides, algorithm="sft")
    return model, TorchEngine(model, cfg.train, cfg.engine)


def _train_step(model, engine, seed: int) -> None:
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))
    engine.backward(model(input_ids=ids, labels=ids).loss)
    engine.step()


OPTIMIZERS = [
    "adamw",
    "adamw_bf16",
    pytest.param(
        "adamw_8bit",
        marks=[
            pytest.mark.skipif(not HAS_TORCHAO, reason="adamw_8bit needs torchao (not installed)"),
            pytest.mark.slow,  # torch.compile of its update, per parameter shape
        ],
    ),
]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_an_engine_checkpoint_resumes_every_optimizer_exactly(tmp_path, optimizer):
    model, engine = _engine(optimizer)
    for seed in (0, 1):
        _train_step(model, engine, seed)
    engine.save_state(tmp_path)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    assert engine.describe() == {"name": "torch", **({"optimizer": optimizer} if optimizer != "adamw" else {})}
    resumed_model, resumed = _engine(optimizer, weights)
    resumed.load_state(tmp_path)
    for seed in (2, 3):
        _train_step(model, engine, seed)
        _train_step(resumed_model, resumed, seed)
    for (name, a), b in zip(model.state_dict().items(), resumed_model.state_dict().values()):
        assert torch.equal(a, b), name
    assert resumed.lr == engine.lr and isinstance(resumed.lr, float)


def test_what_cannot_run_is_refused_naming_train_optimizer(monkeypatch):
    check_optimizer("adamw", "deepspeed")
    check_optimizer("adamw_bf16", "torch")
    with pytest.raises(
        OxrlError, match=r"train\.optimizer=adamw_bf16 runs on the torch engine.*train\.optimizer: adamw"
    ):
        check_optimizer("adamw_bf16", "deepspeed")
    with pytest.raises(OxrlError, match=r"train\.optimizer=adamw_8bit runs on the torch engine"):
        check_optimizer("adamw_8bit", "deepspeed")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a)
    )
    with pytest.raises(OxrlError, match=r"train\.optimizer: adamw_8bit needs torchao.*pip install torchao"):
        check_optimizer("adamw_8bit", "torch")


def test_a_run_with_adamw_bf16_resumes_only_with_it(tmp_path, tiny_model_dir):
    run = tmp_path / "bf16"
    common = ["--set", f"model.name={tiny_model_dir}", "--set", "train.batch_size=4", "-q"]
    proc = oxrl("run", "--alg", "sft", *common, "--set", "train.optimizer=adamw_bf16", "--set", "train.max_steps=2",
                "--set", "train.save_every=1", "-o", str(run), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert all(math.isfinite(m["loss"]) for m in read_metrics(run))
    state = json.loads((run / "checkpoints" / "step-1" / "trainer_state.json").read_text())  # (step 2: final/)
    assert state["engine"] == {"name": "torch", "optimizer": "adamw_bf16"}
    refused = oxrl("run", "--resume", "-o", str(run), "--set", "train.optimizer=adamw", "--set", "train.max_steps=3",
                   cwd=tmp_path)  # fmt: skip
    assert_user_error(refused, "engine.name=torch, train.optimizer=adamw_bf16", "train.optimizer=adamw")


def test_a_bad_optimizer_value_is_one_message(tmp_path, tiny_model_dir):
    proc = oxrl("run", "--alg", "sft", "--set", "train.optimizer=adam", "-o", str(tmp_path / "r"), cwd=tmp_path)
    assert_user_error(proc, "train.optimizer", "adamw_bf16")
    proc = oxrl("run", "--alg", "sft", "--set", "train.optimizer=adamw_bf16", "--set", "engine.name=deepspeed",
                "-o", str(tmp_path / "d"), cwd=tmp_path)  # fmt: skip
    assert_user_error(proc, "train.optimizer=adamw_bf16 runs on the torch engine")
