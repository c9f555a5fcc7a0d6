"""rl: what an RL step is made of, below the loop that drives it — the prompts and each step's sampling, the rollout
batch and its micro-batches (`batch`), the typed records that cross module boundaries (`records`), the completion
and episode strategies (`strategies`), multi-turn episodes (`episodes`), dynamic sampling (`dynamic_sampling`) and
the rollout source, synchronous or asynchronous, chosen once behind one interface (`sources`).

May import: every service package and `scoring`; never `loops`, the trainer, launcher or CLI.
"""
