"""One entry point per algorithm; each registers an import path, so discovery never imports torch."""

from oxrl_core.hookspecs import hookimpl


@hookimpl
def register_algorithms(register):
    register("sgrpo", "oxrl_algs_rl.sgrpo:SGRPO")
    register("cispo", "oxrl_algs_rl.cispo:CISPO")
    register("ppo", "oxrl_algs_rl.ppo:PPO")
    register("rlhf", "oxrl_algs_rl.rlhf:RLHF")
    register("rlaif", "oxrl_algs_rl.rlaif:RLAIF")
