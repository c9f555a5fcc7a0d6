"""One entry point per environment. Each registers an import path, so discovery imports no environment."""

from oxrl_core import hookimpl


@hookimpl
def register_environments(register):
    register("python", "oxrl_envs.python:PythonEnv")
