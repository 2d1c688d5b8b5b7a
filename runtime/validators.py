"""Validators for the attrs configs of every layer, in one place: `attrs.field(validator=positive)`.

They raise `ConfigError` (a `GyreError` and a `ValueError`) naming the field, so a bad topology fails before any
actor starts, with a message a user can act on. Booleans are refused where a number is wanted (`True > 0` would
pass a plain comparison).
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from gyre.runtime.errors import ConfigError

__all__ = ["count", "optional_count", "optional_positive", "positive"]


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """A finite number > 0."""
    if not _is_number(value) or not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{attribute.name} must be a finite number > 0, got {value!r}")


def count(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """An int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{attribute.name} must be an int >= 1, got {value!r}")


optional_positive = attrs.validators.optional(positive)
"""None, or a finite number > 0."""

optional_count = attrs.validators.optional(count)
"""None, or an int >= 1."""
