"""The core's own plugins, registered through the `oxrl` entry-point group like any other."""

from oxrl_core.hookspecs import hookimpl


@hookimpl
def register_datasets(register):
    register("arith", "oxrl_core.task:ArithDataset")
