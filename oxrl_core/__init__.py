"""oxRL core: hook specs, interfaces, config, loops, engines and the `oxrl` CLI.

Importing this package is cheap (no torch); heavy pieces load on first use.

The public API — what a plugin imports, and all it imports — is this package itself: every name in
``__all__`` (``from oxrl_core import Algorithm, Reward, hookimpl, ops``):

- the hook marker: `hookimpl`;
- the interfaces a plugin implements: `Algorithm`, `Reward`, `Dataset`, `RolloutBackend`, `Environment`,
  `ToolEnvironment`; their config base `StrictModel`; `PolicyGradient`, the base of a group-based RL algorithm,
  and the types of its options (`LossAggregation`, `KLEstimator`); the values of `Algorithm.loop` and
  ``data_format`` (`Loop`, `DataFormat`); what a rollout backend takes and gives, `SamplingParams`
  and `Completion`; the batches an algorithm's ``loss`` receives (`SupervisedBatch`, `RLAdvantagesBatch`,
  `RLLossBatch`, `PairedPreferenceBatch`, `UnpairedPreferenceBatch`, `ScoreBatch`);
- what an environment's tools are parsed with: `ToolParser`, `ToolCall`, `HermesParser` (the loop sets an
  environment's ``tool_parser``; a test of a tool environment sets one itself);
- the error a plugin raises for a user's mistake (one message, no traceback): `OxrlError`;
- the modules `ops` (loss maths: masked means, group advantages, KL estimators) and `errors`;
- final answers read out of text (`answers`, the one copy rewards and datasets share): `to_number`,
  `numbers`, `answer_tag`, `gsm8k_answer`, `completion_number`, `numbers_equal`, `last_boxed`,
  `first_integer_equals`, `math_equivalent`;
- helpers for plugins that load models or read data as the core does: `resolve_model_path`, `load_tokenizer`,
  `load_causal_lm` (a model name, path or hub id -> what a run would load), `encode_prompt`,
  `encode_completion` (token ids through the chat template, as the loops tokenise), `HFRolloutBackend`
  (generation with transformers, e.g. for a judge), `is_peft`, `policy_state_dict` (a policy's weights
  with LoRA merged, for a backend's weight sync), `placeholder_token_ids` (the tokens a vision-language model
  never samples, which a backend masks), `path_kind`, `read_data_file` (a local data file or
  directory, as ``data.path`` reads it), `row_number` (the row a message names, as the core's messages do).

A plugin in this repository imports these names and nothing else: never a module path such as
``oxrl_core.interfaces`` (the public modules too come as names, ``from oxrl_core import ops``), so that the
core's modules can move without a plugin noticing (``tests/test_layers.py`` checks). ``oxrl_core.interfaces``,
``oxrl_core.ops``, ``oxrl_core.errors`` and ``oxrl_core.hookspecs`` stay importable under those names for
plugins written against them elsewhere; every other module is private and may change without notice.
"""

from oxrl_core.hookspecs import hookimpl

__version__ = "0.1.0"

#: public name -> the module that defines it (imported on first use: `import oxrl_core` stays torch-free)
_LAZY = {
    # the interfaces and the types they exchange
    "Algorithm": "oxrl_core.algorithm",
    "Reward": "oxrl_core.interfaces",
    "Dataset": "oxrl_core.interfaces",
    "RolloutBackend": "oxrl_core.interfaces",
    "Environment": "oxrl_core.interfaces",
    "ToolEnvironment": "oxrl_core.interfaces",
    "PolicyGradient": "oxrl_core.algorithm",
    "StrictModel": "oxrl_core.interfaces",
    "Loop": "oxrl_core.algorithm",
    "DataFormat": "oxrl_core.algorithm",
    "LossAggregation": "oxrl_core.algorithm",
    "KLEstimator": "oxrl_core.algorithm",
    "SamplingParams": "oxrl_core.interfaces",
    "Completion": "oxrl_core.interfaces",
    "SupervisedBatch": "oxrl_core.interfaces",
    "RLAdvantagesBatch": "oxrl_core.interfaces",
    "RLLossBatch": "oxrl_core.interfaces",
    "PairedPreferenceBatch": "oxrl_core.interfaces",
    "UnpairedPreferenceBatch": "oxrl_core.interfaces",
    "ScoreBatch": "oxrl_core.interfaces",
    "ToolParser": "oxrl_core.tool_parsers",
    "ToolCall": "oxrl_core.tool_parsers",
    "HermesParser": "oxrl_core.tool_parsers",
    "OxrlError": "oxrl_core.errors",
    # final answers
    "to_number": "oxrl_core.answers",
    "numbers": "oxrl_core.answers",
    "answer_tag": "oxrl_core.answers",
    "gsm8k_answer": "oxrl_core.answers",
    "completion_number": "oxrl_core.answers",
    "numbers_equal": "oxrl_core.answers",
    "last_boxed": "oxrl_core.answers",
    "first_integer_equals": "oxrl_core.answers",
    "math_equivalent": "oxrl_core.answers",
    # helpers (heavy: torch / transformers load when one is first used)
    "resolve_model_path": "oxrl_core.models.loading",
    "load_tokenizer": "oxrl_core.models.loading",
    "load_causal_lm": "oxrl_core.models.loading",
    "encode_prompt": "oxrl_core.data.encode",
    "encode_completion": "oxrl_core.data.encode",
    "prompt_text": "oxrl_core.data.images",
    "HFRolloutBackend": "oxrl_core.rollout.hf",
    "is_peft": "oxrl_core.models.lora",
    "policy_state_dict": "oxrl_core.models.lora",
    "placeholder_token_ids": "oxrl_core.models.vision",
    "path_kind": "oxrl_core.data.sources",
    "read_data_file": "oxrl_core.data.sources",
    "row_number": "oxrl_core.scoring.rewards",
    # the run, for scripts (not for plugins)
    "Trainer": "oxrl_core.trainer",
}

#: public modules: ``from oxrl_core import ops`` / ``oxrl_core.ops``
_MODULES = ("ops", "errors", "answers")

__all__ = ["hookimpl", "__version__", *_MODULES, *_LAZY]


def __getattr__(name: str):
    import importlib

    if name in _MODULES:
        return importlib.import_module(f"oxrl_core.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'oxrl_core' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
