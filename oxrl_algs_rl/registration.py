"""One entry point per algorithm; each registers an import path, so discovery never imports torch."""

from oxrl_core.hookspecs import Registers

sgrpo = Registers("algorithm", "sgrpo", "oxrl_algs_rl.sgrpo:SGRPO")
cispo = Registers("algorithm", "cispo", "oxrl_algs_rl.cispo:CISPO")
ppo = Registers("algorithm", "ppo", "oxrl_algs_rl.ppo:PPO")
rlhf = Registers("algorithm", "rlhf", "oxrl_algs_rl.rlhf:RLHF")
rlaif = Registers("algorithm", "rlaif", "oxrl_algs_rl.rlaif:RLAIF")
