"""Arguments renamed in the library: the old keyword still read, with a one-line `DeprecationWarning`."""

import warnings


def renamed_argument(owner, kwargs, old, new, value, default=None, stacklevel=3):
    """The value of argument `new` of `owner` (a class or function name, for the messages): `value`, or, when
    its old name `old` is in `kwargs` (the call's other keyword arguments, from which it is removed), that
    one's, with a `DeprecationWarning` pointing at the call (`stacklevel` 3: the caller of the function that
    calls this one). Both given (`value` other than `default`): a ValueError naming both."""
    if old not in kwargs:
        return value
    old_value = kwargs.pop(old)
    if (value is not None) if default is None else (value != default):
        raise ValueError(f"{owner} got {new}={value!r} and {old}={old_value!r}: {old} is {new}'s old name, "
                         f"give {new} only")
    warnings.warn(f"{owner}({old}=...) is now {owner}({new}=...) (read as such)", DeprecationWarning,
                  stacklevel=stacklevel)
    return old_value
