"""The core's own plugins, one entry point each, found through the `oxrl` group like any other."""

from oxrl_core.hookspecs import Registers

arith = Registers("dataset", "arith", "oxrl_core.task:ArithDataset")
hf = Registers("rollout_backend", "hf", "oxrl_core.rollout_hf:HFRolloutBackend")
