"""run_io: what a run writes and reads back — checkpoints written atomically and found again for `--resume`
(`checkpoint`), the run directory's life (lock, config.yaml, summary.json, error.log, signals: `lifecycle`), metrics to
JSONL / TensorBoard / MLflow (`tracking`), and in-memory inputs recorded as files (`inputs`).

May import: the leaves, `interfaces`, `config`, `engines`, `observability`, `data`, `models`.
"""
