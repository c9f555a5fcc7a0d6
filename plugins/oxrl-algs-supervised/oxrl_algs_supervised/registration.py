"""One entry point per algorithm. Each registers an import path, so discovery never imports torch."""

from oxrl_core import hookimpl


class _Algorithm:
    def __init__(self, name: str, target: str):
        self.name, self.target = name, target

    @hookimpl
    def register_algorithms(self, register):
        register(self.name, self.target)


sft = _Algorithm("sft", "oxrl_algs_supervised.sft:SFT")
cpt = _Algorithm("cpt", "oxrl_algs_supervised.cpt:CPT")
kd = _Algorithm("kd", "oxrl_algs_supervised.kd:KD")
