"""One entry point per algorithm; each registers an import path, so discovery never imports torch."""

from oxrl_core import hookimpl


@hookimpl
def register_algorithms(register):
    register("dpo", "oxrl_algs_preference.dpo:DPO")
    register("ipo", "oxrl_algs_preference.ipo:IPO")
    register("orpo", "oxrl_algs_preference.orpo:ORPO")
    register("kto", "oxrl_algs_preference.kto:KTO")
    register("simpo", "oxrl_algs_preference.simpo:SimPO")
    register("rm", "oxrl_algs_preference.rm:RM")
    register("online_dpo", "oxrl_algs_preference.online_dpo:OnlineDPO")
    register("spin", "oxrl_algs_preference.spin:SPIN")
