"""loops: one run skeleton (`run`: the `Run` every loop drives — engine, checkpoints, metrics, evaluation; `setup`:
what every loop loads) and one file per loop: `supervised`, `preference`, `rl` (with `rl_setup`, which assembles
the RL step's parts from `oxrl_core.rl`).

May import: every service package, `scoring` and `rl`; never the trainer, launcher or CLI.
"""
