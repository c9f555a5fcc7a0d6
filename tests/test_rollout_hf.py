"""The core `hf` rollout backend (the `RolloutBackend` interface, `oxrl_core.interfaces`): transformers generate behind RolloutBackend."""

from __future__ import annotations

import pytest
import torch

from oxrl_core.data.encode import encode_prompt
from oxrl_core.errors import OxrlError
from oxrl_core.interfaces import Completion, RolloutBackend, SamplingParams
from oxrl_core.models.loading import load_causal_lm, load_tokenizer
from oxrl_core.rollout.hf import HFRolloutBackend
from oxrl_core.scoring.evaluation import greedy_completions

# Different lengths, so the batch is left-padded.
PROMPTS = ["What is 2+3?", "Compute 17+345, please.", "Hi"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture
def model(tiny_model_dir):
    return load_causal_lm(str(tiny_model_dir))


@pytest.fixture
def backend(model, tokenizer):
    return HFRolloutBackend(model, tokenizer)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [encode_prompt(tokenizer, p) for p in PROMPTS]


def tokens(result: list[list[Completion]]) -> list[list[list[int]]]:
    return [[c.token_ids for c in group] for group in result]


def check_well_formed(result, n_prompts: int, n: int, max_new_tokens: int, eos: int, version: int = 0):
    assert len(result) == n_prompts
    for group in result:
        assert len(group) == n
        for c in group:
            assert isinstance(c, Completion)
            assert 1 <= len(c.token_ids) <= max_new_tokens
            assert len(c.logprobs) == len(c.token_ids)
            assert all(lp <= 0.0 and lp > float("-inf") for lp in c.logprobs)
            assert c.policy_version == version
            assert eos not in c.token_ids[:-1]  # nothing after the first EOS
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == eos
            else:
                assert c.finish_reason == "length"
                assert len(c.token_ids) == max_new_tokens and eos not in c.token_ids


def test_is_a_rollout_backend(backend):
    assert isinstance(backend, RolloutBackend)
    assert HFRolloutBackend.name == "hf"


def test_n_samples_per_prompt_and_shapes(backend, prompt_ids, tokenizer):
    result = backend.generate(prompt_ids, SamplingParams(n=3, max_new_tokens=6, temperature=1.0, seed=0))
    check_well_formed(result, 3, 3, 6, tokenizer.eos_token_id)
    # Sampling at temperature 1 on a random model: the three samples of a prompt are not all identical.
    assert any(len({tuple(t) for t in group}) > 1 for group in tokens(result))


@pytest.mark.parametrize("batch_size", [None, 2])
def test_greedy_matches_greedy_completions_and_is_deterministic(model, tokenizer, prompt_ids, batch_size):
    backend = HFRolloutBackend(model, tokenizer, batch_size=batch_size)
    sampling = SamplingParams(n=2, max_new_tokens=10, temperature=0.0)
    first = backend.generate(prompt_ids, sampling)
    check_well_formed(first, 3, 2, 10, tokenizer.eos_token_id)
    assert tokens(backend.generate(prompt_ids, sampling)) == tokens(first)
    assert all(group[0].token_ids == group[1].token_ids for group in first)  # greedy: n copies agree

    expected = greedy_completions(model, tokenizer, PROMPTS, 10, batch_size or len(PROMPTS), torch.device("cpu"))
    got = [tokenizer.decode(group[0].token_ids, skip_special_tokens=True) for group in first]
    assert got == expected
    assert any(text for text in got)  # a non-trivial comparison


def test_seed_is_reproducible_and_seeds_differ(backend, prompt_ids):
    sampling = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=123)
    rng_before = torch.get_rng_state()
    a = backend.generate(prompt_ids, sampling)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG is left alone
    torch.manual_seed(999)  # the global state does not matter when a seed is given
    b = backend.generate(prompt_ids, sampling)
    assert tokens(a) == tokens(b)
    assert [[c.logprobs for c in g] for g in a] == [[c.logprobs for c in g] for g in b]
    c = backend.generate(prompt_ids, SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=124))
    assert tokens(c) != tokens(a)


@torch.no_grad()
def teacher_forced_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_a_teacher_forced_forward(backend, model, prompt_ids, temperature):
    """At top_p 1 the logprobs are log_softmax(logits / temperature) of the sampled token; at 1, the model's own."""
    result = backend.generate(prompt_ids, SamplingParams(n=2, max_new_tokens=12, temperature=temperature, seed=7))
    for prompt, group in zip(prompt_ids, result):
        for c in group:
            want = teacher_forced_logprobs(model, prompt, c.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-4, rtol=0)


def test_the_models_own_generation_config_does_not_reshape_sampling(backend, model, prompt_ids):
    """A hub model's generation_config (top_k, repetition_penalty, ...) must not change what is sampled from."""
    model.generation_config.top_k = 5
    model.generation_config.repetition_penalty = 1.5
    result = backend.generate(prompt_ids, SamplingParams(n=2, max_new_tokens=12, temperature=1.0, seed=7))
    for prompt, group in zip(prompt_ids, result):
        for c in group:
            torch.testing.assert_close(
                torch.tensor(c.logprobs), teacher_forced_logprobs(model, prompt, c.token_ids), atol=1e-4, rtol=0
            )
    assert model.generation_config.top_k == 5 and model.generation_config.repetition_penalty == 1.5  # restored


def test_top_p_logprobs_are_renormalised_over_the_nucleus(backend, model, prompt_ids):
    result = backend.generate(prompt_ids, SamplingParams(n=2, max_new_tokens=12, temperature=1.0, top_p=0.5, seed=7))
    for prompt, group in zip(prompt_ids, result):
        for c in group:
            full = teacher_forced_logprobs(model, prompt, c.token_ids)
            got = torch.tensor(c.logprobs)
            assert bool((got >= full - 1e-5).all())  # the truncated distribution puts more mass on each kept token
            assert bool((got > full + 1e-3).any())  # and it really is truncated
            # log p_nucleus(tok) = log p(tok) - log(mass of the nucleus) with mass >= top_p
            assert bool((got - full <= -torch.log(torch.tensor(0.5)) + 1e-4).all())


def test_finish_reasons_length_and_stop(backend, prompt_ids, tokenizer):
    eos = tokenizer.eos_token_id
    # Short: the random model does not reach EOS in 3 greedy tokens.
    short = backend.generate(prompt_ids, SamplingParams(n=1, max_new_tokens=3, temperature=0.0))
    check_well_formed(short, 3, 1, 3, eos)
    assert {c.finish_reason for g in short for c in g} == {"length"}
    # Near-uniform sampling over ~100 tokens for up to 300 steps: most samples hit EOS, at different steps
    # (so rows that stopped early were padded while the others went on), a few may run to the limit.
    result = backend.generate(prompt_ids[:2], SamplingParams(n=6, max_new_tokens=300, temperature=100.0, seed=3))
    check_well_formed(result, 2, 6, 300, eos)
    stopped = [c for g in result for c in g if c.finish_reason == "stop"]
    assert len(stopped) >= 2, [c.finish_reason for g in result for c in g]
    assert len({len(c.token_ids) for c in stopped}) > 1
    assert all(c.token_ids[-1] == eos and len(c.logprobs) == len(c.token_ids) for c in stopped)


def test_update_weights_versions_and_changes_outputs(backend, model, tokenizer, prompt_ids, tiny_model_dir):
    from oxrl_core.models.tiny import build_model

    greedy = SamplingParams(n=1, max_new_tokens=8, temperature=0.0)
    before = backend.generate(prompt_ids, greedy)
    assert all(c.policy_version == 0 for g in before for c in g)

    other = build_model(len(tokenizer), hidden_size=64, num_layers=2, seed=1)
    backend.update_weights(other.state_dict(), policy_version=1)
    after = backend.generate(prompt_ids, greedy)
    assert all(c.policy_version == 1 for g in after for c in g)
    assert tokens(after) != tokens(before)
    assert torch.equal(model.lm_head.weight, other.lm_head.weight)

    with pytest.raises(OxrlError, match="must increase"):
        backend.update_weights(other.state_dict(), policy_version=1)
    with pytest.raises(OxrlError, match="must increase"):
        backend.update_weights(other.state_dict(), policy_version=0)
    assert backend.policy_version == 1

    # A model works as well as a state_dict; the original weights bring the original outputs back.
    original = load_causal_lm(str(tiny_model_dir))
    backend.update_weights(original, policy_version=5)
    restored = backend.generate(prompt_ids, greedy)
    assert tokens(restored) == tokens(before)
    assert all(c.policy_version == 5 for g in restored for c in g)

    # strict=True: a state_dict that does not match is refused
    with pytest.raises(RuntimeError):
        backend.update_weights({"lm_head.weight": other.lm_head.weight}, policy_version=6)

    backend.close()
    assert backend.model is None
    with pytest.raises(OxrlError, match="closed"):
        backend.generate(prompt_ids, greedy)


def test_discover_lists_hf_from_the_core_package(monkeypatch):
    from oxrl_core.plugins import discover

    monkeypatch.delenv("OXRL_PLUGINS", raising=False)
    monkeypatch.delenv("OXRL_STRICT_PLUGINS", raising=False)
    registry = discover()
    assert "hf" in registry.names("rollout_backend")
    reg = registry.get("rollout_backend", "hf")
    assert reg.package == "oxrl"
    assert reg.load() is HFRolloutBackend


# ----------------------------------------------------------------------------- the KV cache generate starts from


def test_prefill_once_and_the_preallocated_cache_sample_what_plain_generate_samples(
    backend, model, prompt_ids, tokenizer
):
    """Each prompt prefilled once and repeated n times, decoding into a preallocated buffer: the same seeded
    samples and (up to float rounding) the same logprobs as plain `generate` over the P·n repeated rows."""
    n, steps = 3, 10
    got = backend.generate(prompt_ids, SamplingParams(n=n, max_new_tokens=steps, temperature=1.0, seed=5))
    width = max(map(len, prompt_ids))
    rows = [[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompt_ids for _ in range(n)]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids for _ in range(n)]
    model.generation_config = backend._clean_generation_config()
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(5)
        out = model.generate(
            input_ids=torch.tensor(rows),
            attention_mask=torch.tensor(mask),
            max_new_tokens=steps,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    scores = torch.log_softmax(torch.stack(out.scores, dim=1).float(), dim=-1)  # (P·n, steps, V)
    flat = [c for group in got for c in group]
    for i, c in enumerate(flat):
        assert c.token_ids == out.sequences[i, width : width + len(c.token_ids)].tolist()
        want = scores[i, torch.arange(len(c.token_ids)), torch.tensor(c.token_ids)]
        torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-5, rtol=0)


def test_preallocated_layer_holds_what_a_dynamic_layer_holds():
    from transformers.cache_utils import DynamicLayer

    from oxrl_core.rollout.hf import PreallocatedLayer

    torch.manual_seed(0)
    chunks = [(torch.randn(2, 3, t, 4), torch.randn(2, 3, t, 4)) for t in (5, 1, 1, 2)]  # (B, H, t, D)
    plain, buffered = DynamicLayer(), PreallocatedLayer(capacity=7)  # the last chunk outgrows the buffer
    for k, v in chunks:
        want, got = plain.update(k, v), buffered.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert buffered.get_seq_length() == plain.get_seq_length()
    assert buffered.get_seq_length() == 9
    buffered.crop(-2)
    plain.crop(-2)
    extra = (torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4))
    assert all(torch.equal(a, b) for a, b in zip(plain.update(*extra), buffered.update(*extra)))
    buffered.repeat_rows(2)  # row i becomes rows 2i, 2i+1
    assert buffered.keys.shape == (4, 3, 8, 4)
    assert torch.equal(buffered.keys[2], plain.keys[1]) and torch.equal(buffered.values[3], plain.values[1])


def test_a_model_with_a_sliding_window_cache_generates_with_transformers_default(tokenizer):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        sliding_window=4,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = MistralForCausalLM(config).eval()
    backend = HFRolloutBackend(model, tokenizer)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    assert backend._prefilled_cache(ids, torch.ones_like(ids), 2, 10) is None
    result = backend.generate([ids[0].tolist()], SamplingParams(n=2, max_new_tokens=5, temperature=1.0, seed=0))
    for c in result[0]:
        want = teacher_forced_logprobs(model, ids[0].tolist(), c.token_ids)
        torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-4, rtol=0)
