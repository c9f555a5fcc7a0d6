"""Issue 15: bad values are refused up front, and numbers reported to the user mean one thing.

- the class "bad values accepted": a NaN or infinite float anywhere in a config (every section, and an
  algorithm plugin's ``alg:`` section) is refused naming the field;
- item 2: ``train.seed`` outside what the random generators take, and a ``rollout.max_new_tokens`` past
  the model's context, are refused naming the field, the limit and the fix; the hf backend's KV buffers
  are sized to what generation uses, not to ``max_new_tokens``;
- item 18: every loop logs, as ``lr``, the rate its step used (checked against the linear schedule);
- item 21 (``oxrl score``): rows are numbered from 1 everywhere, in warnings as in the output.
"""

from __future__ import annotations

import json
import typing

import pytest
import torch
from conftest import oxrl, read_metrics, write_jsonl
from pydantic import BaseModel

from oxrl_core.config import RunConfig, load_run_config, validate_alg_section
from oxrl_core.errors import OxrlError


def assert_user_error(proc, *needles: str) -> None:
    """Exit status 2, every needle in the message, and no traceback."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    for needle in needles:
        assert needle in out, (needle, out)


# ----------------------------------------------------------------------------- non-finite floats, as a class


def _float_fields(model_cls: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted names of every float field of a config class and of its section classes."""
    names = []
    for name, field in model_cls.model_fields.items():
        annotation = field.annotation
        args = typing.get_args(annotation) or (annotation,)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names += _float_fields(annotation, f"{prefix}{name}.")
        elif float in args:
            names.append(f"{prefix}{name}")
    return names


FLOAT_FIELDS = _float_fields(RunConfig)


def test_every_float_field_of_the_run_config_is_found():
    """The sweep below covers every section (a new float field is covered without editing this test)."""
    sections = {name.split(".")[0] for name in FLOAT_FIELDS}
    assert {"train", "rollout", "engine", "lora", "reward"} <= sections, FLOAT_FIELDS
    assert "train.lr" in FLOAT_FIELDS and "rollout.temperature" in FLOAT_FIELDS


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_a_non_finite_float_anywhere_in_the_config_is_refused_naming_the_field(field, value):
    with pytest.raises(OxrlError) as info:
        load_run_config(overrides=[f"{field}={value}"], algorithm="sft")
    assert f"{field}: Input should be a finite number" in str(info.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_float_in_an_algorithm_plugin_section_is_refused(value):
    """Plugin configs subclass `StrictModel`, so they refuse NaN/inf with no code of their own."""
    from oxrl_algs_rl.sgrpo import SGRPO

    config = load_run_config(algorithm="sgrpo")
    config.alg = {"clip_high": value}
    with pytest.raises(OxrlError, match=r"alg\.clip_high: Input should be a finite number"):
        validate_alg_section(config, SGRPO.Config)


@pytest.mark.parametrize(
    "field", ["train.max_steps", "train.save_every", "engine.world_size", "rollout.n", "data.max_length"]
)
def test_an_integer_beyond_64_bits_is_refused_naming_the_field(field):
    with pytest.raises(OxrlError, match=rf"{field}: must fit in a signed 64-bit integer"):
        load_run_config(overrides=[f"{field}={10**30}"], algorithm="sft")


def test_infinite_lr_through_the_cli_is_one_line_and_creates_no_run(tmp_path):
    run = tmp_path / "run"
    proc = oxrl("run", "--alg", "sft", "--set", "train.lr=.inf", "-o", str(run), cwd=tmp_path)
    assert_user_error(proc, "train.lr", "finite")
    assert not (run / "final").exists() and not (run / "checkpoints").exists()


# ----------------------------------------------------------------------------- item 2: ranges


@pytest.mark.parametrize("seed", [2**63, 2**32, -1])
def test_seed_out_of_range_is_refused_naming_the_field(seed):
    with pytest.raises(OxrlError, match=r"train\.seed: Input should be"):
        load_run_config(overrides=[f"train.seed={seed}"], algorithm="sft")
    assert load_run_config(overrides=[f"train.seed={2**32 - 1}"], algorithm="sft").train.seed == 2**32 - 1


def test_huge_seed_through_the_cli_is_refused_not_a_torch_traceback(tmp_path):
    proc = oxrl("run", "--alg", "sft", "--set", f"train.seed={2**63}", "-o", str(tmp_path / "run"), cwd=tmp_path)
    assert_user_error(proc, "train.seed", str(2**63))


def test_max_new_tokens_past_the_models_context_is_refused_at_start_up(tmp_path, tiny_model_dir):
    """The tiny model has 512 positions: a million new tokens is refused before any step, naming the field,
    the model's limit and the largest value that fits (it used to ask for a KV buffer of ~GBs)."""
    run = tmp_path / "run"
    proc = oxrl(
        "run",
        "--alg",
        "sgrpo",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        "rollout.max_new_tokens=1000000",
        "--set",
        "train.max_steps=2",
        "-o",
        str(run),
        cwd=tmp_path,
    )
    assert_user_error(proc, "rollout.max_new_tokens=1000000", "512 positions", "set rollout.max_new_tokens <=")
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip()


def test_oxrl_eval_max_new_tokens_past_the_context_is_refused(tmp_path, tiny_model_dir):
    from typer.testing import CliRunner

    from oxrl_core.cli import app

    data = write_jsonl(tmp_path / "ev.jsonl", [{"prompt": "What is 1+1?", "answer": "2"}])
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--model",
            str(tiny_model_dir),
            "--data",
            str(data),
            "--reward",
            "exact_match",
            "--max-new-tokens",
            "1000000",
        ],
    )
    # in-process the OxrlError reaches the runner (the console script prints it as one line and exits 2)
    assert isinstance(result.exception, OxrlError), result.output
    message = str(result.exception)
    assert "--max-new-tokens=1000000 does not fit" in message and "512 positions" in message
    assert "set --max-new-tokens <= " in message


@pytest.fixture(scope="module")
def hf_backend(tiny_model_dir):
    from oxrl_core.models.loading import load_causal_lm, load_tokenizer
    from oxrl_core.rollout.hf import HFRolloutBackend

    return HFRolloutBackend(load_causal_lm(str(tiny_model_dir)).eval(), load_tokenizer(str(tiny_model_dir)))


def test_hf_backend_refuses_a_generation_longer_than_the_context(hf_backend):
    from oxrl_core.interfaces import SamplingParams

    prompt = hf_backend.tokenizer("What is 2+3?")["input_ids"]
    with pytest.raises(OxrlError, match=r"max_new_tokens=600 does not fit the model's context.*512 positions"):
        hf_backend.generate([prompt], SamplingParams(n=2, max_new_tokens=600, temperature=1.0, seed=0))
    groups = hf_backend.generate([prompt], SamplingParams(n=2, max_new_tokens=3, temperature=1.0, seed=0))
    assert [len(c.token_ids) <= 3 for c in groups[0]] == [True, True]


def test_kv_buffer_grows_with_use_instead_of_being_allocated_for_max_new_tokens():
    """A planned capacity of 10^9 positions allocates the prompt + `FIRST_STRETCH`, then doubles."""
    from oxrl_core.rollout.hf import PreallocatedLayer

    layer = PreallocatedLayer(capacity=10**9)
    prompt = torch.randn(2, 1, 5, 4)  # (B, H, T, D)
    keys, _ = layer.update(prompt, prompt)
    assert layer._keys.shape[-2] == 5 + PreallocatedLayer.FIRST_STRETCH and torch.equal(keys, prompt)
    steps = [torch.randn(2, 1, 1, 4) for _ in range(PreallocatedLayer.FIRST_STRETCH + 1)]
    for step in steps:
        keys, values = layer.update(step, step)
    assert layer._keys.shape[-2] == 2 * (5 + PreallocatedLayer.FIRST_STRETCH)  # doubled once, not 10^9
    assert torch.equal(keys, torch.cat([prompt, *steps], dim=-2)) and keys.shape[-2] == layer.length
    small = PreallocatedLayer(capacity=8)  # the planned capacity still bounds the buffer
    small.update(prompt, prompt)
    assert small._keys.shape[-2] == 8


# ----------------------------------------------------------------------------- item 18: lr logged


LR, STEPS = 1e-3, 3


@pytest.mark.parametrize("alg", ["sft", "dpo", "sgrpo"])
def test_lr_logged_is_the_rate_the_step_used(tmp_path, tiny_model_dir, alg):
    """Linear schedule, no warm-up, 3 optimiser steps: step k uses LR·(1 − (k−1)/3), so step 1 logs LR and
    the last step LR/3 (the RL loop used to log the next step's rate: 0 at the last step)."""
    from oxrl_core.trainer import Trainer

    rows = {
        "sft": [{"prompt": f"What is {a}+{b}?", "response": str(a + b)} for a in range(4) for b in range(4)],
        "dpo": [
            {"prompt": f"What is {a}+{b}?", "chosen": str(a + b), "rejected": str(a + b + 1)}
            for a in range(4)
            for b in range(4)
        ],
        "sgrpo": [{"prompt": f"What is {a}+{b}?", "answer": str(a + b)} for a in range(4) for b in range(4)],
    }[alg]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    extra = ["rollout.n=2", "rollout.max_new_tokens=4", "reward.name=exact_match"] if alg == "sgrpo" else []
    run = tmp_path / alg
    Trainer(
        alg=alg,
        model=str(tiny_model_dir),
        data=str(data),
        output_dir=run,
        quiet=True,
        overrides=[
            f"train.max_steps={STEPS}",
            f"train.lr={LR}",
            "train.lr_scheduler=linear",
            "train.warmup_steps=0",
            "train.batch_size=4",
            "train.eval_every=0",
            *extra,
        ],
    ).train()
    lrs = [m["lr"] for m in read_metrics(run) if "lr" in m]
    assert len(lrs) == STEPS
    assert lrs == pytest.approx([LR * (1 - k / STEPS) for k in range(STEPS)], rel=1e-6)


# ----------------------------------------------------------------------------- item 21: oxrl score rows


FAILS_ON_TWO = """
from oxrl_core.interfaces import Reward


class FailsOnTwo(Reward):
    name = "fails_on_two"

    def score(self, prompts, completions, examples):
        if "two" in completions:
            raise ValueError("cannot score two")
        return [1.0] * len(completions)
"""


def test_oxrl_score_numbers_rows_from_one_in_warnings_and_output(tmp_path):
    plugin = tmp_path / "fails.py"
    plugin.write_text(FAILS_ON_TWO)
    data = write_jsonl(tmp_path / "c.jsonl", [{"completion": c} for c in ("one", "two", "three")])
    proc = oxrl("score", "--reward", f"{plugin}:FailsOnTwo", "--data", str(data), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [r["row"] for r in out] == [1, 2, 3]
    assert "error" in out[1] and "error" not in out[0]
    assert "failed on row 2: ValueError" in proc.stderr, proc.stderr  # the same number as the output's
    assert "row 1:" not in proc.stderr and "row 0" not in proc.stderr and "Traceback" not in proc.stderr


def test_reward_warnings_name_the_rows_data_file_row(caplog):
    """Inside a run a batch holds rows from anywhere in the file: the warning names the file's row."""
    from oxrl_core.scoring.rewards import score_batch

    class Fails:
        name, timeout_s = "fails", 5.0

        def score(self, prompts, completions, examples):
            if "bad" in completions:
                raise ValueError("no")
            return [1.0] * len(completions)

    examples = [{"_row": 17}, {"_row": 41}, {}]
    with caplog.at_level("WARNING"):
        scores, _ = score_batch(Fails(), ["", "", ""], ["ok", "bad", "bad"], examples)
    assert scores == [1.0, 0.0, 0.0]
    assert (
        "failed on row 41" in caplog.text and "rows 41, 3)" in caplog.text
    )  # a row without a file number: its place, 1-based
