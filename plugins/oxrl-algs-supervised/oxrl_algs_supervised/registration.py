"""One entry point per algorithm. Each registers an import path, so discovery never imports torch."""

from oxrl_core import hookimpl


@hookimpl
def register_algorithms(register):
    register("sft", "oxrl_algs_supervised.sft:SFT")
    register("cpt", "oxrl_algs_supervised.cpt:CPT")
    register("kd", "oxrl_algs_supervised.kd:KD")
    register("rft", "oxrl_algs_supervised.rft:RFT")
