"""Errors the engine raises for bad input. Each message names the file, tensor or
limit at fault and says what to do; callers map them to CLI or RPC errors."""


class TandemError(Exception):
    """Base of every error tandem raises on purpose (never a bug)."""


class ModelLoadError(TandemError):
    """A model file, directory or shape cannot be loaded as asked."""


class UnsupportedModelError(ModelLoadError):
    """The architecture is not one tandem implements."""


class InvalidRequestError(TandemError):
    """A request the engine cannot run: too long, bad parameters."""
