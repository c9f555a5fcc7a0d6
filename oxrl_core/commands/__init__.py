"""commands: the `oxrl` subcommands beside `oxrl run` — `doctor`, `init` (scaffold), `eval`, `check-model`,
`bug-report`. The command line itself is `oxrl_core.cli`.

May import: everything below (the trainer, loops, services, config, the leaves).
"""
