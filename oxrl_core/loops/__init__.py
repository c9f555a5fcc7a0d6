"""loops: one run skeleton (`run`: the `Run` every loop drives — engine, checkpoints, metrics, evaluation) and one
file per loop: `supervised`, `preference`, `rl` (with `rollouts` for single-turn completions and `episodes` for
multi-turn environments).

May import: every service package and everything below them; never the trainer, launcher or CLI.
"""
