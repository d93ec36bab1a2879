"""The errors a start ends with that are the user's to fix: the server prints their one line, no traceback."""


class ModelSourceError(Exception):
    """A one-line, user-facing reason the model could not be resolved (print it, no traceback)."""


class ConfigError(ValueError):
    """A one-line, user-facing reason this engine cannot serve the model as the flags ask (an unsupported
    architecture, flags that do not go together): print it, no traceback."""
