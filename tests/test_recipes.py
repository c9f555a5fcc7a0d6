"""The dataset recipes in examples/recipes/ (real models and hub datasets) run end to end when the
tiny model and the local fixtures (shaped like the real rows) are swapped in — one `--set` each."""

from __future__ import annotations

import pytest
from conftest import ROOT, oxrl, read_metrics

RECIPES = ROOT / "examples" / "recipes"
DATA = ROOT / "tests" / "fixtures" / "datasets"
QUICK = [
    "--set",
    "train.max_steps=2",
    "--set",
    "train.batch_size=2",
    "--set",
    "train.grad_accum_steps=1",
    "--set",
    "train.eval_every=0",
    "--set",
    "train.save_every=0",
    "--set",
    "train.warmup_steps=0",
    "--set",
    "rollout.n=2",
    "--set",
    "rollout.max_new_tokens=4",
    "--set",
    "data.max_length=400",
]
#: recipe -> (overrides that point it at the fixtures, a metric its run must log)
CASES = {
    "gsm8k_sgrpo": ([f"data.train.path={DATA / 'gsm8k'}"], "reward/mean"),
    "openr1_math_cispo": (
        [f"data.train.path={DATA / 'openr1_math'}", f"data.eval.path={DATA / 'math'}"],
        "reward/mean",
    ),
    "ultrafeedback_dpo": ([f"data.train.path={DATA / 'ultrafeedback_binarized'}"], "rewards/accuracies"),
    "hh_rlhf_rm": ([f"data.train.path={DATA / 'hh_rlhf'}"], "rewards/accuracies"),
    "alpaca_sft": ([f"data.train.path={DATA / 'alpaca'}"], "loss/nll"),
    "code_sgrpo": (
        [f"data.train={ROOT / 'tests' / 'fixtures' / 'code' / 'train.jsonl'}", "reward.workers=2"],
        "reward/mean",
    ),
    "mix_sft": (
        [
            f"data.train=[{{source: alpaca, ratio: 3, path: {DATA / 'alpaca'}}}, "
            f"{{source: gsm8k, ratio: 1, path: {DATA / 'gsm8k'}}}]"
        ],
        "data/gsm8k",
    ),
}


def test_every_recipe_is_tested_and_documented():
    readme = (ROOT / "README.md").read_text()
    names = sorted(p.stem for p in RECIPES.glob("*.yaml"))
    assert names == sorted(CASES)
    for name in names:
        assert f"examples/recipes/{name}.yaml" in readme


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_recipe_runs_on_the_fixture(name, tmp_path, tiny_model_dir):
    overrides, metric = CASES[name]
    sets = [arg for o in overrides for arg in ("--set", o)]
    run = tmp_path / name
    proc = oxrl(
        "run",
        "--config",
        str(RECIPES / f"{name}.yaml"),
        "--set",
        f"model.name={tiny_model_dir}",
        *QUICK,
        *sets,
        "-o",
        str(run),
        "--quiet",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2]
    assert metric in records[0], sorted(records[0])
    assert (run / "final" / "config.json").is_file()
