"""api/server/body.py's checks without a server: the nesting depth against a plain recursive count,
and the messages for each kind of broken body."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.server.body import MAX_JSON_DEPTH, check_json_body, is_json_content_type, json_too_deep
from api.server.errors import APIError


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab[]{}"\\,:'),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(value=_json, limit=st.integers(0, 6))
def test_depth_matches_a_recursive_count(value, limit) -> None:
    body = json.dumps(value).encode()
    assert json_too_deep(body, limit) == (_depth(value) > limit)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"", "body is empty"),
        (b"  \n", "body is empty"),
        (b'{"a": 1', "not complete JSON"),
        (b'{"a": "\\ud800"}', "lone surrogate escape `\\ud800`"),
        (b'{"a": "\\udc00 ok"}', "lone surrogate escape `\\udc00`"),
        (b'{"a": nope}', "not valid JSON"),
        (b'{"a": "\xff"}', "not valid UTF-8"),
        (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "nested more than"),
        (b"[" * 100_000, "nested more than"),  # msgspec's own RecursionError
    ],
)
def test_broken_bodies_get_clear_400s(body, says) -> None:
    with pytest.raises(APIError) as exc:
        check_json_body(body)
    assert exc.value.status_code == 400 and says in exc.value.message


def test_good_bodies_pass() -> None:
    assert check_json_body(b'{"model": "m", "a": "\\ud83d\\ude00"}') == "m"
    nested = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert check_json_body(nested) is None


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("application/json", True),
        ("Application/JSON; charset=UTF-8", True),
        ('application/json; charset="utf-8"', True),
        ("application/json; charset=latin-1", False),
        ("text/plain", False),
        ("application/x-www-form-urlencoded", False),
        (None, False),
        ("", False),
    ],
)
def test_content_types(value, ok) -> None:
    assert is_json_content_type(value) is ok
