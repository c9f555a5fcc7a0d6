"""One entry point per algorithm; each registers an import path, so discovery never imports torch."""

from oxrl_core import hookimpl


@hookimpl
def register_algorithms(register):
    register("sgrpo", "oxrl_algs_rl.sgrpo:SGRPO")
    register("cispo", "oxrl_algs_rl.cispo:CISPO")
    register("ppo", "oxrl_algs_rl.ppo:PPO")
    register("rlhf", "oxrl_algs_rl.rlhf:RLHF")
    register("rlaif", "oxrl_algs_rl.rlaif:RLAIF")
    register("gspo", "oxrl_algs_rl.gspo:GSPO")
    register("rloo", "oxrl_algs_rl.rloo:RLOO")
    register("reinforce_pp", "oxrl_algs_rl.reinforce_pp:REINFORCEPP")
    register("reinforce_pp_baseline", "oxrl_algs_rl.reinforce_pp_baseline:REINFORCEPPBaseline")
