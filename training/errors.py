"""Errors raised by the training pipeline for bad input."""


class DataError(ValueError):
    """Bad or missing training data. The message says what is wrong and how to fix it."""


class DataNotFoundError(DataError, FileNotFoundError):
    """A data directory or file does not exist."""


class LineCountMismatchError(DataError):
    """The two sides of a parallel corpus have different numbers of lines."""


class ConfigError(ValueError):
    """A training configuration that cannot work (the message says why)."""


class BackupError(RuntimeError):
    """No backup of the run can be read (the message names the files and how to start fresh)."""
