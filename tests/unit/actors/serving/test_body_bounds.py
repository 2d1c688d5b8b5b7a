"""The bounded JSON reader (finding 3 of Hardening): any JSON value within the bounds decodes to itself; one beyond
them, or holding a lone surrogate or bytes that are not UTF-8, is an ApiError (invalid_request) naming the limit,
never a RecursionError, a TypeError later in the tokenizer, or a 500."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.actors.serving._api_common import JsonLimits, json_object_text, loads_bounded
from gyre.actors.serving.sessions import ApiError

LIMITS = JsonLimits(max_depth=6, max_string_chars=12)
LONE = ["\ud800", "x\udfffy", "\udbff!"]
"""Strings holding a surrogate with no partner next to it (a pair would decode to one character)."""

strings = st.one_of(st.text(max_size=16), st.sampled_from(LONE))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), strings)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(strings, inner, max_size=4)),
    max_leaves=40,
)


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


def all_strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for key, item in value.items() for s in [key, *all_strings(item)]]
    if isinstance(value, list):
        return [s for item in value for s in all_strings(item)]
    return []


def broken_limits(value: Any) -> set[str]:
    """What the reader must refuse `value` for (any one of them)."""
    broken = set()
    if depth(value) > LIMITS.max_depth:
        broken.add("max_json_depth")
    texts = all_strings(value)
    if any(len(s) > LIMITS.max_string_chars for s in texts):
        broken.add("max_json_string_chars")
    if any("\ud800" <= ch <= "\udfff" for s in texts for ch in s):
        broken.add("surrogate")
    return broken


@settings(max_examples=400, deadline=None)
@given(values, st.booleans())
def test_values_within_the_bounds_decode_to_themselves_and_others_are_refused(value: Any, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    raw = text.encode("utf-8", "surrogatepass")  # a surrogate written raw is not valid UTF-8: refused too
    broken = broken_limits(value)
    if not broken:
        assert loads_bounded(raw, LIMITS) == value
        return
    with pytest.raises(ApiError) as error:
        loads_bounded(raw, LIMITS)
    assert error.value.kind == "invalid_request" and error.value.status == 400
    named = {name for name in ("max_json_depth", "max_json_string_chars") if name in error.value.message}
    if named:
        assert named <= broken
    else:
        assert "surrogate" in broken and ("surrogate" in error.value.message or "UTF-8" in error.value.message)


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=0, max_value=3000), st.sampled_from(["[", '{"k":']))
def test_any_nesting_is_decoded_or_refused_naming_the_depth(levels: int, opening: str) -> None:
    closing = "]" if opening == "[" else "}"
    text = opening * levels + "0" + closing * levels
    if levels <= LIMITS.max_depth:
        assert depth(loads_bounded(text.encode(), LIMITS)) == levels
    else:
        with pytest.raises(ApiError, match="max_json_depth"):
            loads_bounded(text.encode(), LIMITS)


def test_nesting_far_past_pythons_recursion_limit_is_a_400() -> None:
    for levels in (990, 100_000):
        with pytest.raises(ApiError, match="max_json_depth"):
            loads_bounded(b"[" * levels + b"]" * levels, JsonLimits())


def test_text_that_is_not_json_or_not_utf8_is_a_400() -> None:
    for raw in (b'{"a": ', b"\xff\xfe{}", b"", b"NaNa"):
        with pytest.raises(ApiError) as error:
            loads_bounded(raw, JsonLimits())
        assert error.value.status == 400
    assert loads_bounded(b'\xef\xbb\xbf{"bom": 1}', JsonLimits()) == {"bom": 1}  # a UTF-8 BOM is allowed


def test_tool_call_arguments_are_decoded_within_the_same_bounds() -> None:
    assert json_object_text('{"path": "a"}', "arguments", LIMITS) == '{"path": "a"}'
    with pytest.raises(ApiError, match="max_json_depth"):
        json_object_text('{"a": ' + "[" * 990 + "]" * 990 + "}", "arguments", LIMITS)
    with pytest.raises(ApiError, match="surrogate"):
        json_object_text('{"a": "\\ud800"}', "arguments", LIMITS)
