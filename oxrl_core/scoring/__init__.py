"""scoring: rewards at run time with their time limits and failure accounting (`rewards`), `oxrl score` on a file
of completions (`offline`), and held-out evaluation (`evaluation`).

May import: everything below the loops (the leaves, `interfaces`, `config`, `engines`, `observability`, `data`,
`models`, `run_io`, `rollout`).
"""
