"""One entry point per algorithm. Each registers an import path, so discovery never imports torch."""

from oxrl_core.hookspecs import Registers

sft = Registers("algorithm", "sft", "oxrl_algs_supervised.sft:SFT")
cpt = Registers("algorithm", "cpt", "oxrl_algs_supervised.cpt:CPT")
kd = Registers("algorithm", "kd", "oxrl_algs_supervised.kd:KD")
rft = Registers("algorithm", "rft", "oxrl_algs_supervised.rft:RFT")
