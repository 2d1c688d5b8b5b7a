"""Gyre's message classes: frozen attrs data, one module per conversation.

Importing this package imports every message module in it, so that the codec's registry (built from
`gyre.messages._define.REGISTERED`) always knows every message type.
"""

import importlib as _importlib
import pkgutil as _pkgutil

from gyre.messages._define import REGISTERED, message

for _module in _pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        _importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["REGISTERED", "message"]
