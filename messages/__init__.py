"""Gyre's message classes: frozen attrs data, one module per conversation.

The bottom layer: messages import nothing from Gyre but each other; the runtime's codec, the policies and the
actors import them (the engines do not). They hold data and no behaviour, so they define no errors: encoding,
checking frames and the errors of both live in `gyre.runtime`.

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
