"""One entry point per algorithm; each registers an import path, so discovery never imports torch."""

from oxrl_core.hookspecs import Registers

dpo = Registers("algorithm", "dpo", "oxrl_algs_preference.dpo:DPO")
ipo = Registers("algorithm", "ipo", "oxrl_algs_preference.ipo:IPO")
orpo = Registers("algorithm", "orpo", "oxrl_algs_preference.orpo:ORPO")
kto = Registers("algorithm", "kto", "oxrl_algs_preference.kto:KTO")
simpo = Registers("algorithm", "simpo", "oxrl_algs_preference.simpo:SimPO")
rm = Registers("algorithm", "rm", "oxrl_algs_preference.rm:RM")
online_dpo = Registers("algorithm", "online_dpo", "oxrl_algs_preference.online_dpo:OnlineDPO")
spin = Registers("algorithm", "spin", "oxrl_algs_preference.spin:SPIN")
