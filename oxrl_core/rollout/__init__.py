"""rollout: generating completions for RL — the in-process transformers backend (`hf`), Ray rollout actors
(`actors`), the weight-sync probe (`sync`), the rollout log (`log`) and environments run in worker processes
(`env_worker`).

May import: the leaves, `interfaces`, `config`, the plugin registry, `engines`, `observability`, `data`, `models`,
`run_io`.
"""
