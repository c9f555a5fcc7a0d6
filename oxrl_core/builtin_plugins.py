"""The core's own plugins, one entry point each, found through the `oxrl` group like any other."""

from oxrl_core.hookspecs import hookimpl


class _ArithDataset:
    @hookimpl
    def register_datasets(self, register):
        register("arith", "oxrl_core.task:ArithDataset")


class _HFRolloutBackend:
    @hookimpl
    def register_rollout_backends(self, register):
        register("hf", "oxrl_core.rollout_hf:HFRolloutBackend")


arith = _ArithDataset()
hf = _HFRolloutBackend()
