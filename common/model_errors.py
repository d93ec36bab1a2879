"""The one error that resolving or converting a model raises (common/model_source.py, common/gguf_convert.py)."""


class ModelSourceError(Exception):
    """A one-line, user-facing reason the model could not be resolved (print it, no traceback)."""
