"""Multi-turn episodes (``env.name``): token-exact by construction, masks, rewards, batching and faults.

The backend here is scripted: every generate call answers with the next scripted turn, and its logprobs
come from a plain transformers forward of the model on the exact context (an independent computation).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from oxrl_core.config import RunConfig
from oxrl_core.interfaces import Completion, Environment, RolloutBackend, SamplingParams, ToolEnvironment
from oxrl_core.models.tiny import build_model, build_tokenizer
from oxrl_core.rl.batch import policy_forward, rollout_batch
from oxrl_core.rl.episodes import Episodes, extension_ids, render
from oxrl_core.rollout.hf import HFRolloutBackend
from oxrl_core.scoring.rewards import Failures
from oxrl_core.tool_parsers import ToolCall, parser_for

sys.path.insert(0, str(Path(__file__).parent))
from archs import FAMILIES, HISTORY_REWRITING_TEMPLATE
from archs import build_tokenizer as family_tokenizer


class Engine:
    device = torch.device("cpu")


class ScriptedBackend(RolloutBackend):
    """Generate call k answers every context with ``turns[k]`` (+ EOS); logprobs from a plain forward."""

    name = "scripted"

    def __init__(self, model, tokenizer, turns: list[str]):
        self.model, self.tokenizer, self.turns, self.calls, self.sampled = model, tokenizer, turns, [], []

    def logprobs(self, context: list[int], ids: list[int]) -> list[float]:
        with torch.no_grad():
            logits = self.model(torch.tensor([context + ids])).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        return [float(logp[len(context) - 1 + j, t]) for j, t in enumerate(ids)]

    def generate(self, prompt_token_ids, sampling):
        text = self.turns[min(len(self.calls), len(self.turns) - 1)]
        self.calls.append((len(prompt_token_ids), sampling.n))
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        self.sampled.append(ids)
        out = []
        for context in prompt_token_ids:
            lp = self.logprobs(list(context), ids)
            out.append([Completion(list(ids), lp, "stop", 0) for _ in range(sampling.n)])
        return out

    def update_weights(self, state, policy_version):
        pass


class ToolEcho(Environment):
    """Step style: every turn gets a tool message; done after 3 turns. Rewards 0.5 and 0.25 per turn."""

    name = "tool_echo"

    def step(self, messages):
        turns = sum(m["role"] == "assistant" for m in messages)
        if turns >= 3:
            return [], 0.25, True
        return [{"role": "tool", "name": "calc", "content": str(6 * turns)}], 0.5, False


def config(**env) -> RunConfig:
    return RunConfig.model_validate({"algorithm": "sgrpo", "env": {"name": "x", **env}, "rollout": {"n": 2}})


def play(tokenizer, model, turns, env_cls=ToolEcho, rows=None, **env):
    backend = ScriptedBackend(model, tokenizer, turns)
    runner = Episodes(env_cls, env_cls.Config(), config(**env), tokenizer, backend)
    rows = rows or [{"prompt": "What is 2*3?", "answer": "6"}]
    episodes = runner.play(rows, SamplingParams(n=2, max_new_tokens=64))
    return runner, backend, episodes


# ----------------------------------------------------------------------------- the extension, by hand


def test_extension_of_the_builtin_template_is_the_tool_turn_and_the_next_generation_prompt():
    tok = build_tokenizer()
    before = [{"role": "user", "content": "What is 2*3?"}]
    turn = {"role": "assistant", "content": '<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call>'}
    added = [{"role": "tool", "name": "calc", "content": "6"}]
    ids = extension_ids(tok, before, turn, added, ended_eos=True, tools=[])
    # the sampled <|end|> closed the assistant turn; the environment adds the tool turn and the next prompt
    assert tok.decode(ids) == "<|tool|>6<|end|><|assistant|>"
    # a turn cut without EOS: the template's <|end|> is the environment's
    assert tok.decode(extension_ids(tok, before, turn, added, ended_eos=False, tools=[])) == (
        "<|end|><|tool|>6<|end|><|assistant|>"
    )


def test_a_template_that_rewrites_history_breaks_the_extension():
    tok = family_tokenizer("qwen3")
    tok.chat_template = HISTORY_REWRITING_TEMPLATE
    before = [{"role": "user", "content": "q"}]
    plain = {"role": "assistant", "content": "a"}
    added = [{"role": "tool", "name": "calc", "content": "6"}]
    assert extension_ids(tok, before, plain, added, True, []) is not None
    thinking = {"role": "assistant", "content": "<think>hm</think>a"}
    assert extension_ids(tok, before, thinking, added, True, []) is None


# ----------------------------------------------------------------------------- token-exact, every family


@pytest.fixture(scope="module")
def family_models(arch_model):
    cache = {}

    def get(family):
        if family not in cache:
            path = arch_model(family)
            tok = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[family] = (tok, model)
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_trained_ids_are_exactly_the_sampled_tokens_plus_the_environments(family, family_models):
    tok, model = family_models(family)
    parser = parser_for(tok)
    call = parser.format([ToolCall("calc", {"expr": "2*3"})])
    runner, backend, episodes = play(tok, model, [call, call, "6"], max_turns=3, max_tokens=400)
    # one batched backend call per turn: 1 prompt x n=2, then both live episodes together
    assert backend.calls == [(1, 2), (2, 1), (2, 1)]
    batch = rollout_batch(
        [e.prompt_ids for e in episodes], [e.as_completion() for e in episodes], [0.0] * 2, 2, 0, Engine()
    )
    for i, e in enumerate(episodes):
        assert e.ended == "done" and e.fallbacks == 0 and e.turns == 3
        n_prompt, total = len(e.prompt_ids), len(e.prompt_ids) + len(e.token_ids)
        row = batch["input_ids"][i, :total].tolist()
        # the sampled tokens, in order, at exactly the masked positions; everything else is the environment's
        scored = (batch["mask"][i] > 0).nonzero().flatten() + 1  # mask position t scores token t+1
        assert [row[t] for t in scored.tolist()] == [t for ids in backend.sampled for t in ids]
        env_tokens = [row[t] for t in range(n_prompt, total) if t not in set(scored.tolist())]
        # ... and the whole row reads as the template's rendering of the conversation (up to the last EOS)
        text = tok.decode(row, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        conversation = render(tok, e.messages, [], False)
        assert conversation.startswith(text[: len(text) - len(tok.eos_token)]), (text, conversation)
        assert env_tokens, "the environment's tool turns are in the row"
        # the trainer's logprobs of the sampled tokens equal the backend's (fp32)
        with torch.no_grad():
            out = policy_forward(
                model, None, {k: batch[k][i : i + 1] for k in ("input_ids", "attention_mask", "mask")}, 1.0
            )
        gap = (out["logp"][0] - batch["logp_rollout"][i]).abs() * batch["mask"][i]
        assert float(gap.max()) < 1e-4
    assert runner.metrics(episodes)["env/retemplate_fallbacks"] == 0


def test_a_history_rewriting_template_takes_the_fallback_and_counts_it(family_models):
    tok, model = family_models("qwen3")
    tok = AutoTokenizer.from_pretrained(tok.name_or_path)
    tok.chat_template = HISTORY_REWRITING_TEMPLATE
    call = "<think>use the tool</think>" + parser_for(tok).format([ToolCall("calc", {"expr": "2*3"})])
    runner, backend, episodes = play(tok, model, [call, "6", "6"], max_turns=3, max_tokens=400)
    metrics = runner.metrics(episodes)
    assert metrics["env/retemplate_fallbacks"] == 2  # both episodes, once each (turn 1 -> 2)
    for e in episodes:
        # the training sample restarts from the template's rendering of the conversation at the break
        # (user, the thinking turn, its tool result) ...
        rendered = render(tok, e.messages[:3], [], True)
        assert e.prompt_ids == tok(rendered, add_special_tokens=False)["input_ids"]
        # ... followed by exactly what the model sampled after it (turns 2 and 3) and the environment's turn between
        turn2, turn3 = backend.sampled[1], backend.sampled[2]
        assert e.token_ids[: len(turn2)] == turn2 and e.token_ids[-len(turn3) :] == turn3
        assert sum(e.sampled) == len(turn2) + len(turn3) and e.ended == "done"


# ----------------------------------------------------------------------------- masks and rewards, by hand


def test_masks_cover_only_the_models_tokens_and_no_loss_reaches_the_environments():
    tok = build_tokenizer()
    model = build_model(len(tok))
    runner, backend, episodes = play(tok, model, ["ab", "c", "d"], max_turns=3, max_tokens=400)
    e = episodes[0]
    p = len(e.prompt_ids)
    # <|user|>What is 2*3?<|end|><|assistant|> | a b <|end|> | <|tool|>6<|end|><|assistant|> | c <|end|> | ...
    env1 = tok("<|tool|>6<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    env2 = tok("<|tool|>12<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    a, b, c, d = (tok.convert_tokens_to_ids(x) for x in "abcd")
    assert e.token_ids == [a, b, eos] + env1 + [c, eos] + env2 + [d, eos]
    assert e.sampled == [1, 1, 1] + [0] * len(env1) + [1, 1] + [0] * len(env2) + [1, 1]
    batch = rollout_batch(
        [x.prompt_ids for x in episodes], [x.as_completion() for x in episodes], [1.0, 0.0], 2, 0, Engine()
    )
    mask = batch["mask"][0]
    assert mask.sum() == 7 and mask[: p - 1].sum() == 0
    assert batch["logp_rollout"][0][mask == 0].abs().sum() == 0  # the environment's tokens have no logprob
    # SGRPO: advantages, and so the loss's gradient, are zero on the environment's tokens
    from oxrl_algs_rl.sgrpo import SGRPO

    alg = SGRPO()
    batch["logp_old"] = batch["logp_rollout"].clone()
    added, _ = alg.advantages({**batch, "group_size": 2})
    assert (added["adv"][0][mask == 0] == 0).all() and (added["adv"][0][mask > 0] != 0).all()
    logp = batch["logp_rollout"].clone().requires_grad_(True)
    loss, _ = alg.loss(
        {**batch, **added, "logp": logp, "entropy": torch.zeros_like(logp), "tis_weight": torch.ones_like(logp)}
    )
    loss.backward()
    assert (logp.grad[batch["mask"] == 0] == 0).all() and (logp.grad[batch["mask"] > 0] != 0).any()


class Quiz(ToolEnvironment):
    """Tools style; no reward(): the final answer is scored by the run's reward."""

    name = "quiz"

    def calc(self, expr: str) -> str:
        """Evaluate.

        Args:
            expr: an expression
        """
        return str(eval(expr, {"__builtins__": {}}))  # test expressions only, no builtins


class Graded(Quiz):
    def reward(self, row, messages):
        return 2.0


class Right:
    name, timeout_s = "right", 5.0

    def score(self, prompts, completions, examples):
        return [1.0 if c.strip() == e["answer"] else 0.0 for c, e in zip(completions, examples)]


def test_per_turn_rewards_add_up_and_final_answers_are_scored():
    tok = build_tokenizer()
    model = build_model(len(tok))
    # step style: 0.5 + 0.5 + 0.25, no final-answer scoring
    runner, _, episodes = play(tok, model, ["a", "b", "c"], max_turns=3)
    scores, _ = runner.rewards(episodes, Right(), Failures("right"))
    assert scores == [1.25, 1.25]
    # tools style: one tool call, then the final answer "6", scored by the run's reward
    call = parser_for(tok).format([ToolCall("calc", {"expr": "2*3"})])
    runner, _, episodes = play(tok, model, [call, "6"], env_cls=Quiz, max_turns=3)
    assert [e.messages[2] for e in episodes] == [{"role": "tool", "name": "calc", "content": "6"}] * 2
    scores, _ = runner.rewards(episodes, Right(), Failures("right"))
    assert scores == [1.0, 1.0] and runner.metrics(episodes)["env/tool_calls"] == 1.0
    # ... and an environment's own reward() replaces the final-answer score
    runner, _, episodes = play(tok, model, [call, "7"], env_cls=Graded, max_turns=3)
    assert runner.rewards(episodes, Right(), Failures("right"))[0] == [2.0, 2.0]


# ----------------------------------------------------------------------------- limits and faults


def test_turn_and_token_limits_end_episodes():
    tok = build_tokenizer()
    model = build_model(len(tok))
    runner, backend, episodes = play(tok, model, ["a"] * 5, max_turns=2)
    assert all(e.ended == "max_turns" and e.turns == 2 for e in episodes) and len(backend.calls) == 2
    runner, _, episodes = play(tok, model, ["abcdefgh"] * 5, max_turns=5, max_tokens=12)
    assert all(e.ended == "max_tokens" and e.used <= 12 for e in episodes)
    assert runner.metrics(episodes)["env/truncated"] == 2


class Raises(Environment):
    name = "raises"

    def step(self, messages):
        raise RuntimeError("boom")


class Hangs(Environment):
    name, timeout_s = "hangs", 0.2

    def step(self, messages):
        time.sleep(3)
        return [], 0.0, True


class Malformed(Environment):
    name = "malformed"

    def step(self, messages):
        return [{"role": "tool"}], math.nan, "yes"


@pytest.mark.parametrize(
    "env_cls, counter, error",
    [
        (Raises, "env/errors", "step() raised RuntimeError: boom (test_episodes.py:"),
        (Hangs, "env/timeouts", "step() ran past the environment's timeout_s=0.2 s"),
        (Malformed, "env/errors", "step() must return a list of {role, content} messages"),
    ],
)
def test_a_failing_environment_ends_its_episode_with_reward_zero(env_cls, counter, error):
    tok = build_tokenizer()
    runner, _, episodes = play(tok, build_model(len(tok)), ["a", "b"], env_cls=env_cls, max_turns=3)
    scores, _ = runner.rewards(episodes, Right(), Failures("right"))
    assert scores == [0.0, 0.0] and runner.metrics(episodes)[counter] == 2
    assert all(any(e.sampled) for e in episodes)  # each still a trainable sample
    assert all(e.error.startswith(error) for e in episodes), [e.error for e in episodes]  # what failed, where


def test_a_malformed_tool_call_is_answered_with_an_error_and_the_episode_goes_on():
    tok = build_tokenizer()
    good = parser_for(tok).format([ToolCall("calc", {"expr": "2*3"})])
    runner, _, episodes = play(
        tok,
        build_model(len(tok)),
        ["<tool_call>{not json</tool_call>", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', good, "6"],
        env_cls=Quiz,
        max_turns=4,
    )
    e = episodes[0]
    assert e.messages[2]["content"].startswith("error:") and "nope" in e.messages[4]["content"]
    assert e.messages[6]["content"] == "6" and e.ended == "done"
    metrics = runner.metrics(episodes)
    assert metrics["env/bad_tool_calls"] == 4 and metrics["env/tool_calls"] == 1.0


# ----------------------------------------------------------------------------- shards (rollout actors, ranks)


class Remote(HFRolloutBackend):
    """A stand-in for the rollout actors: every turn's shards in one call, generated in reverse order."""

    remote = True

    def generate_shards(self, shards):
        self.shard_calls = getattr(self, "shard_calls", 0) + 1
        return [self.generate(prompts, sampling) for prompts, sampling in shards[::-1]][::-1]


def test_a_shard_plays_the_same_episodes_wherever_it_is_played():
    """Shard k samples with its own seed: alone, beside another shard, or through a remote backend's
    ``generate_shards`` (one call per turn for all shards), its episodes are the same; `collect` gives the
    episodes in shard order with the metrics of them all."""
    tok = build_tokenizer()
    model = build_model(len(tok)).eval()
    rows = [{"prompt": f"What is {a}*7?", "answer": str(7 * a)} for a in range(2, 6)]
    sampling = SamplingParams(n=2, max_new_tokens=12, temperature=1.0, seed=11)

    def runner(backend):
        return Episodes(ToolEcho, ToolEcho.Config(), config(max_turns=3), tok, backend)

    local = runner(HFRolloutBackend(model, tok))
    alone = local.play_shards([(0, rows[:2])], sampling) + local.play_shards([(1, rows[2:])], sampling)
    together = local.play_shards([(0, rows[:2]), (1, rows[2:])], sampling)
    remote_backend = Remote(model, tok)
    remote = runner(remote_backend).play_sharded(rows, sampling, shards=2, engine=None)
    assert remote_backend.shard_calls == 3  # one call per turn
    as_ids = lambda eps: [(e.prompt_ids, e.token_ids, e.sampled) for e in eps]
    assert as_ids(alone) == as_ids(together) == as_ids(remote)
    assert as_ids(alone[:4]) != as_ids(local.play_shards([(0, rows[:2])], replace(sampling, seed=12)))
    failures = Failures("tool_echo", "environment")
    prompts, completions, scores, metrics, _ = local.collect(together, Right(), Failures("right"), failures)
    assert prompts == [e.prompt_ids for e in together] and [c.token_ids for c in completions] == [
        e.token_ids for e in together
    ]
    assert scores == [sum(e.step_rewards) for e in together]  # step style: the environment's rewards
    assert metrics["reward/mean"] == pytest.approx(sum(scores) / 8)
    assert metrics["env/turns"] == pytest.approx(sum(e.turns for e in together) / 8)
    assert (failures.samples, failures.failed, metrics["env/error_share"]) == (8, 0, 0.0)
    assert "env/first_error" not in metrics
