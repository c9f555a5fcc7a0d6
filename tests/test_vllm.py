"""The `vllm` rollout backend (plugins/oxrl-vllm): agreement with `hf`, sampling contract, in-place
weight sync and the probe check, through the Python API and the real CLI.

One engine serves the whole module (starting one costs seconds); tests that load other weights put
the original ones back. Everything is skipped, with the reason, when vLLM does not import.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e 'plugins/oxrl-vllm[cpu]' or '[gpu]')")

from conftest import oxrl, read_metrics
from test_rollout_hf import PROMPTS, check_well_formed, teacher_forced_logprobs, tokens

from oxrl_core.config import RolloutConfig
from oxrl_core.data.encode import encode_prompt
from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import RolloutBackend, SamplingParams
from oxrl_core.models.loading import load_causal_lm, load_tokenizer
from oxrl_core.rollout.hf import HFRolloutBackend
from oxrl_core.rollout.sync import check_weight_sync, probe_sequence
from oxrl_vllm.backend import VLLMRolloutBackend, request_seed


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    """The trainer's model; tests that change it restore it."""
    return load_causal_lm(str(tiny_model_dir))


@pytest.fixture(scope="module")
def engine(model, tokenizer, tiny_model_dir):
    backend = VLLMRolloutBackend.build(model, tokenizer, str(tiny_model_dir), RolloutConfig(backend="vllm"))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def hf(model, tokenizer):
    return HFRolloutBackend(model, tokenizer)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [encode_prompt(tokenizer, p) for p in PROMPTS]


def logprobs(result) -> torch.Tensor:
    return torch.tensor([lp for group in result for c in group for lp in c.logprobs])


def test_is_a_rollout_backend_found_through_the_entry_point(engine, monkeypatch):
    from oxrl_core.plugins import discover

    assert isinstance(engine, RolloutBackend) and VLLMRolloutBackend.name == "vllm" and VLLMRolloutBackend.can_score()
    monkeypatch.delenv("OXRL_PLUGINS", raising=False)
    registration = discover().get("rollout_backend", "vllm")
    assert registration.package == "oxrl-vllm" and registration.target == "oxrl_vllm.backend:VLLMRolloutBackend"


def test_greedy_agrees_with_hf(engine, hf, prompt_ids, tokenizer):
    """Same tiny model, float32 both sides: the same greedy tokens, logprobs equal to ~1e-6."""
    sampling = SamplingParams(n=2, max_new_tokens=12, temperature=0.0)
    got, want = engine.generate(prompt_ids, sampling), hf.generate(prompt_ids, sampling)
    check_well_formed(got, 3, 2, 12, tokenizer.eos_token_id)
    assert tokens(got) == tokens(want)
    assert all(group[0].token_ids == group[1].token_ids for group in got)  # greedy: n copies
    torch.testing.assert_close(logprobs(got), logprobs(want), atol=1e-4, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_those_of_the_sampling_distribution(engine, model, prompt_ids, tokenizer, temperature):
    """vLLM's processed logprobs: log_softmax(logits / temperature) of the sampled token, as the trainer computes."""
    result = engine.generate(prompt_ids, SamplingParams(n=3, max_new_tokens=10, temperature=temperature, seed=7))
    check_well_formed(result, 3, 3, 10, tokenizer.eos_token_id)
    for prompt, group in zip(prompt_ids, result):
        for c in group:
            want = teacher_forced_logprobs(model, prompt, c.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-4, rtol=0)


def test_top_p_logprobs_are_renormalised_over_the_nucleus(engine, model, prompt_ids):
    result = engine.generate(prompt_ids, SamplingParams(n=2, max_new_tokens=10, temperature=1.0, top_p=0.5, seed=7))
    for prompt, group in zip(prompt_ids, result):
        for c in group:
            full = teacher_forced_logprobs(model, prompt, c.token_ids)
            got = torch.tensor(c.logprobs)
            assert bool((got >= full - 1e-5).all()) and bool((got > full + 1e-3).any())
            assert bool((got - full <= -torch.log(torch.tensor(0.5)) + 1e-4).all())


def test_seeds_reproduce_and_prompts_get_their_own_streams(engine, tokenizer):
    prompts = [[5, 20, 30, 40], [7, 8, 9, 10]]  # near-uniform model: a shared random stream would show
    sampling = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=123)
    a, b = engine.generate(prompts, sampling), engine.generate(prompts, sampling)
    assert tokens(a) == tokens(b)
    torch.testing.assert_close(logprobs(a), logprobs(b), atol=1e-6, rtol=0)
    assert tokens(engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=124))) != tokens(
        a
    )
    assert a[0][0].token_ids != a[1][0].token_ids and a[0][0].token_ids != a[0][1].token_ids
    assert request_seed(123, 0) != request_seed(123, 1) and request_seed(123, 0) == request_seed(123, 0) < 2**63


def test_many_seeded_prompts_in_one_call_reproduce(engine, tokenizer):
    """More prompt tokens in one call than the engine's step budget (4096 on CPU), every request seeded:
    the held-out evaluation's shape. With chunked prefill vLLM rewound the seeded generators of the
    split prompts (`CPU Generator does not use offset` on CPU); the backend prefills each prompt whole."""
    prompts = [
        tokenizer.encode(f"Question {i}: what is {i} plus {i + 1}? Think about it step by step, please. " * 2)
        for i in range(80)
    ]
    assert sum(map(len, prompts)) > 8192
    sampling = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=11)
    a, b = engine.generate(prompts, sampling), engine.generate(prompts, sampling)
    assert tokens(a) == tokens(b)
    assert len({tuple(c.token_ids) for g in a for c in g}) > 40  # every request its own stream


def test_an_engine_exception_is_one_clear_error(engine, prompt_ids, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CPU Generator does not use offset")

    monkeypatch.setattr(engine.llm, "generate", broken)
    with pytest.raises(
        OxrlError, match="rollout backend 'vllm': generate failed inside vLLM: RuntimeError: CPU Generator"
    ):
        engine.generate(prompt_ids, SamplingParams(n=1, max_new_tokens=2, seed=0))


def test_finish_reasons_and_eos_kept_like_hf(engine, prompt_ids, tokenizer):
    eos = tokenizer.eos_token_id
    short = engine.generate(prompt_ids, SamplingParams(n=1, max_new_tokens=3, temperature=0.0))
    assert {c.finish_reason for g in short for c in g} == {"length"}
    # near-uniform over ~100 tokens for up to 300 steps: most samples stop at EOS, at different steps
    result = engine.generate(prompt_ids[:2], SamplingParams(n=6, max_new_tokens=300, temperature=2.0, seed=3))
    check_well_formed(result, 2, 6, 300, eos)
    stopped = [c for g in result for c in g if c.finish_reason == "stop"]
    assert len(stopped) >= 2 and len({len(c.token_ids) for c in stopped}) > 1
    assert all(c.token_ids[-1] == eos for c in stopped)


def test_bad_sampling_is_refused(engine, prompt_ids):
    with pytest.raises(OxrlError, match="at most 2"):
        engine.generate(prompt_ids, SamplingParams(temperature=3.0))
    with pytest.raises(OxrlError, match="at least one token"):
        engine.generate([[]], SamplingParams())


def test_score_equals_the_trainers_logprobs(engine, hf, tokenizer, prompt_ids):
    probe = probe_sequence(tokenizer, prompt_ids[0])
    torch.testing.assert_close(torch.tensor(engine.score(probe)), torch.tensor(hf.score(probe)), atol=1e-5, rtol=0)
    assert len(engine.score(probe)) == len(probe) - 1


def test_update_weights_in_place_then_the_probe_matches(engine, model, hf, tokenizer, prompt_ids):
    """A sync loads the trainer's new weights into the running engine (and drops the prefix cache):
    before it the probe check fails, after it the check passes and generations follow the new policy."""
    probe = probe_sequence(tokenizer, prompt_ids[0])
    greedy = SamplingParams(n=1, max_new_tokens=8, temperature=0.0)
    original = copy.deepcopy(model.state_dict())
    engine.generate(prompt_ids, greedy)  # fills the prefix cache with the old weights' blocks
    start = engine.policy_version
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        with pytest.raises(OxrlError, match=f"policy version {start + 1}"):
            check_weight_sync(engine, model, probe, start + 1, 1e-3, nullcontext)
        engine.update_weights(model, start + 1)
        metrics = check_weight_sync(engine, model, probe, start + 1, 1e-3, nullcontext)
        assert metrics["sync/probe_logprob_diff"] < 1e-4
        after = engine.generate(prompt_ids, greedy)
        assert tokens(after) == tokens(hf.generate(prompt_ids, greedy))
        assert all(c.policy_version == start + 1 for g in after for c in g)
        for prompt, group in zip(prompt_ids, after):  # no stale prefix-cache blocks
            torch.testing.assert_close(
                torch.tensor(group[0].logprobs),
                teacher_forced_logprobs(model, prompt, group[0].token_ids),
                atol=1e-4,
                rtol=0,
            )
        with pytest.raises(OxrlError, match="must increase"):
            engine.update_weights(model, start + 1)
    finally:
        model.load_state_dict(original)
        engine.update_weights(original, engine.policy_version + 1)  # a state_dict works as well as a module
    assert (
        check_weight_sync(engine, model, probe, engine.policy_version, 1e-3, nullcontext)["sync/probe_logprob_diff"]
        < 1e-4
    )


def test_options_are_validated_before_the_engine_starts(tiny_model_dir, model, tokenizer):
    with pytest.raises(
        OxrlError, match="rollout.tensor_paralel_size: unknown field.*did you mean 'tensor_parallel_size'"
    ):
        VLLMRolloutBackend.build(model, tokenizer, str(tiny_model_dir), RolloutConfig(tensor_paralel_size=1))
    with pytest.raises(OxrlError, match=r"rollout.engine_kwargs: \['seed'\] are set by the backend"):
        VLLMRolloutBackend.build(model, tokenizer, str(tiny_model_dir), RolloutConfig(engine_kwargs={"seed": 1}))


@pytest.mark.slow
def test_close_frees_the_engine_and_a_new_one_starts(tiny_model_dir, model, tokenizer, engine, prompt_ids):
    """Runs last in the module: a second engine in this process after the first one is closed."""
    greedy = SamplingParams(n=1, max_new_tokens=6, temperature=0.0)
    before = tokens(engine.generate(prompt_ids, greedy))
    engine.close()
    with pytest.raises(OxrlError, match="closed"):
        engine.generate(prompt_ids, greedy)
    engine.close()  # twice is fine
    second = VLLMRolloutBackend.build(model, tokenizer, str(tiny_model_dir), RolloutConfig(backend="vllm"))
    try:
        assert tokens(second.generate(prompt_ids, greedy)) == before
    finally:
        second.close()


# ----------------------------------------------------------------------------- the real CLI

PLUGINS = '''
from oxrl_core.interfaces import Reward
from oxrl_vllm.backend import VLLMRolloutBackend


class Varied(Reward):
    """Distinct characters per completion: rewards differ within a group, so every step changes the weights."""

    name = "varied"

    def score(self, prompts, completions, examples):
        return [len(set(c)) / 8 for c in completions]


class SkipsSyncs(VLLMRolloutBackend):
    """Syncs version 1, then only bumps the version: the engine keeps stale weights."""

    name = "skips_syncs"

    def update_weights(self, state, policy_version):
        if policy_version >= 2:
            self.policy_version = policy_version
            return
        super().update_weights(state, policy_version)
'''


def vllm_run(tmp_path: Path, model_dir, *args):
    plugin = tmp_path / "vllm_plugins.py"
    plugin.write_text(PLUGINS)
    return oxrl(
        "run",
        "--alg",
        "sgrpo",
        "--set",
        f"model.name={model_dir}",
        "--set",
        "train.batch_size=4",
        "--set",
        "rollout.n=2",
        "--set",
        "rollout.max_new_tokens=6",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.lr=1e-2",
        "--set",
        "train.lr_scheduler=constant",
        "--set",
        f"reward.name={plugin}:Varied",
        *args,
        cwd=tmp_path,
    )


@pytest.mark.slow
def test_cli_run_with_vllm_syncs_and_verifies_every_step(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    proc = vllm_run(
        tmp_path,
        tiny_model_dir,
        "--set",
        "rollout.backend=vllm",
        "--set",
        "train.max_steps=2",
        "--set",
        "rollout.tis_cap=2",
        "-q",
        "-o",
        str(run),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = read_metrics(run)
    assert [m["policy/version"] for m in metrics] == [0.0, 1.0]  # strictly on-policy
    assert metrics[0]["loss"] != 0  # the weights really change, so the step-2 samples prove the sync
    for m in metrics:
        assert m["sync/probe_tolerance"] == 1e-3 and m["sync/probe_logprob_diff"] < 1e-4
        assert m["rollout/logprob_diff"] < 1e-4
        assert "tis/weight_mean" in m and m["tis/clipped_frac"] == 0.0
    assert (run / "final" / "config.json").is_file()


@pytest.mark.slow
def test_cli_skipped_sync_is_caught_by_the_probe(tmp_path, tiny_model_dir):
    run = tmp_path / "stale"
    proc = vllm_run(
        tmp_path,
        tiny_model_dir,
        "--set",
        f"rollout.backend={tmp_path / 'vllm_plugins.py'}:SkipsSyncs",
        "--set",
        "train.max_steps=4",
        "--set",
        "train.save_every=1",
        "-o",
        str(run),
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "weight sync check failed after the weight sync, policy version 2" in proc.stderr
    assert "rollout backend 'skips_syncs'" in proc.stderr and "tolerance 0.001" in proc.stderr
    assert "checkpoints/step-1" in proc.stderr and (run / "checkpoints" / "step-1" / "trainer_state.json").is_file()
    assert [m["step"] for m in read_metrics(run)] == [1]


def test_cli_bad_vllm_option_is_a_clear_error(tmp_path, tiny_model_dir):
    proc = oxrl(
        "run",
        "--alg",
        "sgrpo",
        "--set",
        f"model.name={tiny_model_dir}",
        "--set",
        "rollout.backend=vllm",
        "--set",
        "rollout.gpu_memory_utilisation=0.5",
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "rollout.gpu_memory_utilisation" in proc.stderr and "gpu_memory_utilization" in proc.stderr


@pytest.mark.slow
def test_cli_builtin_task_sgrpo_with_vllm_including_the_held_out_evaluation(tmp_path, tiny_model_dir):
    """`oxrl run --alg sgrpo --set rollout.backend=vllm` on the built-in task, whose held-out evaluation
    sends every eval prompt at once (it failed there before the first step, issue 14). The tiny model
    directory stands in for the built-in model to skip its 450-step warm start (the data, rewards and
    evaluation are the built-in task's)."""
    run = tmp_path / "run"
    proc = oxrl(
        "run",
        "--alg",
        "sgrpo",
        "--set",
        "rollout.backend=vllm",
        "--set",
        "train.max_steps=1",
        "--set",
        f"model.name={tiny_model_dir}",
        "-o",
        str(run),
        cwd=tmp_path,
        timeout=1500,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    assert "held-out before training" in out and "before →" in out  # evaluated before and after
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1] and metrics[0]["rollout/logprob_diff"] < 1e-4
    assert (run / "final" / "config.json").is_file()


@pytest.mark.slow
def test_multi_turn_episodes_with_the_vllm_backend_are_token_exact(tmp_path):
    """The calculator on the built-in model with vLLM generating every turn: tool calls are made and the
    trainer's logprobs of the sampled tokens match vLLM's as closely as in single-turn runs."""
    run_dir = tmp_path / "calc-vllm"
    out = oxrl(
        "run", "--alg", "sgrpo", "--set", "env.name=calculator", "--set", "rollout.backend=vllm",
        "--set", "train.max_steps=2", "--set", "train.batch_size=4", "-o", str(run_dir),
    )  # fmt: skip
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    for m in read_metrics(run_dir):
        assert m["env/tool_calls"] > 0.5 and m["env/errors"] == 0
        assert m["rollout/logprob_diff"] < 1e-4 and m["sync/probe_logprob_diff"] < 1e-4


def test_a_vlm_served_by_vllm_never_samples_its_placeholders_and_scores_as_the_trainer(tmp_path):
    """A tiny Idefics3 (the SmolVLM layout, whose vLLM module imports without torchvision) on text prompts: vLLM
    samples from the distribution without the model's never-sampled tokens (image token and delimiters, biased out
    by `never_sampled_bias`) and its processed logprobs equal the trainer's masked ones (token_stats, the model as
    a run loads it) to 1e-4 at temperature 1; without the bias they differ by the placeholders' mass."""
    from vlm_archs import build_vlm, never_sampled_ids

    from oxrl_core.models.token_head import token_stats
    from oxrl_vllm.backend import never_sampled_bias

    model_dir = build_vlm("idefics3", tmp_path / "idefics3")
    tokenizer, model = load_tokenizer(str(model_dir)), load_causal_lm(str(model_dir)).eval()
    never = never_sampled_ids("idefics3", tokenizer)
    assert never_sampled_bias(model, tokenizer) == {i: -100.0 for i in never}
    assert never_sampled_bias(None, tokenizer, str(model_dir)) == {i: -100.0 for i in never}  # `oxrl eval`'s way
    backend = VLLMRolloutBackend.build(model, tokenizer, str(model_dir), RolloutConfig(backend="vllm"))
    try:
        prompts = [encode_prompt(tokenizer, p) for p in PROMPTS]
        result = backend.generate(prompts, SamplingParams(n=4, max_new_tokens=8, temperature=1.0, seed=5))
        gaps, unmasked_gaps = [], []
        for prompt, group in zip(prompts, result):
            for c in group:
                assert not set(c.token_ids) & set(never)
                ids = torch.tensor([prompt + c.token_ids])  # (1, T)
                pos = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
                inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
                with torch.no_grad():
                    logp = token_stats(model, inputs, torch.zeros_like(pos), pos, ids[0, pos + 1])["logp"]
                    raw = torch.log_softmax(model(**inputs).logits[0, pos].float(), -1).gather(
                        -1, ids[0, pos + 1, None]
                    )
                gaps.append((logp - torch.tensor(c.logprobs)).abs())
                unmasked_gaps.append((raw[:, 0] - torch.tensor(c.logprobs)).abs())
        assert float(torch.cat(gaps).max()) < 1e-4
        assert float(torch.cat(unmasked_gaps).mean()) > 1e-3  # the mass the bias takes out is not negligible here
    finally:
        backend.close()
