"""The core's own plugins, one entry point each, found through the `oxrl` group like any other."""

from oxrl_core.hookspecs import hookimpl


@hookimpl
def register_datasets(register):
    register("arith", "oxrl_core.data.task:ArithDataset")
    register("shapes", "oxrl_core.data.shapes:ShapesDataset")


@hookimpl
def register_rollout_backends(register):
    register("hf", "oxrl_core.rollout.hf:HFRolloutBackend")


@hookimpl
def register_environments(register):
    register("calculator", "oxrl_core.data.task:CalculatorEnv")
    register("second_look", "oxrl_core.data.shapes:SecondLookEnv")
