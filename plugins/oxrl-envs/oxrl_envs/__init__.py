"""oxRL environment plugins: multi-turn tasks for the RL loop (``env.name``; the `Environment` interface,
`oxrl_core.Environment`).

One module per environment: `python` (``python``: the model runs Python code with a ``run_python`` tool,
in the sandbox of the ``code`` reward, `oxrl_rewards.sandbox`).
"""
