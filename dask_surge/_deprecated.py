"""Old names kept importable for one release, with a :class:`DeprecationWarning` naming the new one."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["renamed"]


def renamed(module: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) giving each old name of ``names`` as its new name's value.

    Parameters
    ----------
    module : str
        The module's ``__name__``.
    names : dict of str to str
        Old name -> the name it was renamed to, in the same module.

    Examples
    --------
    >>> import types, warnings
    >>> m = sys.modules["demo"] = types.ModuleType("demo")
    >>> m.new = 1
    >>> m.__getattr__ = renamed("demo", {"old": "new"})
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     value = m.old
    >>> value, str(caught[0].message)
    (1, 'demo.old was renamed demo.new; use the new name (the old one will be removed)')
    >>> del sys.modules["demo"]
    """

    def __getattr__(name: str) -> Any:
        new = names.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} was renamed {module}.{new}; use the new name (the old one will be removed)",
                      DeprecationWarning, stacklevel=2)
        return getattr(sys.modules[module], new)

    return __getattr__
