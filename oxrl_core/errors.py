"""User-facing errors: the CLI prints these as one clear message, no traceback."""


class OxrlError(Exception):
    """A problem with the user's input (config, data, plugin, environment).

    The CLI prints the message and exits with status 2; anything else that
    escapes is a bug in oxRL and keeps its traceback.
    """


class PluginError(OxrlError):
    """A plugin is unknown, broken, or does not implement its interface."""
