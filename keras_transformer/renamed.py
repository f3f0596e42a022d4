"""Renamed names: an old name is still read, with a one-line note, until keras-transformer `REMOVED_IN`.

The library's old keyword arguments are read by `renamed_arguments` (a `DeprecationWarning`); kt-train's,
kt-evaluate's and kt-export's old config keys and flags by common/run_dir.py (`RENAMED_SETTINGS`, a note on
stderr), with the same `REMOVED_IN`. docs/design.md, "Names with one meaning, old names still read", lists
every old name.
"""

import functools
import inspect
import warnings

# The release that removes every old name (this one is keras_transformer.__version__).
REMOVED_IN = "0.3.0"


def renamed_note(old, new):
    """Every old name's note, the library's warnings and the commands' notes alike: "OLD is now NEW (read as
    such; the old name will be removed in keras-transformer REMOVED_IN)". (The Makefile's note for ALPHA is
    written out in full; tests/test_training_config.py checks that it is this one.)"""
    return f"{old} is now {new} (read as such; the old name will be removed in keras-transformer {REMOVED_IN})"


def renamed_arguments(**new_names):
    """Decorator: the function (or a class's `__init__`) also takes each keyword `old` of `old=new`, the old
    name of its argument `new`, with a one-line `DeprecationWarning` pointing at the call. Both names given,
    whatever their values, is a ValueError naming both. The messages name the function, or the class of an
    `__init__`.

        @renamed_arguments(max_length="max_positions")
        def __init__(self, vocab_size, max_positions=None, **kwargs): ...
    """
    def decorate(function):
        signature = inspect.signature(function)
        for old, new in new_names.items():
            if new not in signature.parameters or old in signature.parameters:
                raise TypeError(f"renamed_arguments({old}={new!r}): {function.__qualname__} must take {new} "
                                f"and not {old}")
        path = function.__qualname__.split(".")
        owner = path[-2] if path[-1] == "__init__" and len(path) > 1 else path[-1]

        @functools.wraps(function)
        def with_old_names(*args, **kwargs):
            for old, new in new_names.items():
                if old in kwargs:
                    kwargs[new] = renamed_value(owner, old, new, kwargs.pop(old),
                                                signature.bind_partial(*args, **kwargs).arguments)
            return function(*args, **kwargs)

        # What inspect (and Keras, which reads a layer's __init__ arguments) sees: the function's own arguments.
        with_old_names.__signature__ = signature
        return with_old_names

    return decorate


def renamed_value(owner, old, new, old_value, given, stacklevel=3):
    """`old_value`, given as `owner`'s old keyword `old`, as the value of `new`, with a `DeprecationWarning`
    (`stacklevel` as `warnings.warn`'s from here: 3, the caller of the function that calls this one); a
    ValueError when `new` is among the arguments `given` too."""
    if new in given:
        raise ValueError(f"{owner} got {new}={given[new]!r} and {old}={old_value!r}: {old} is {new}'s old name, "
                         f"give {new} only")
    warnings.warn(renamed_note(f"{owner}({old}=...)", f"{owner}({new}=...)"), DeprecationWarning,
                  stacklevel=stacklevel)
    return old_value
