"""Schema fuzzing against a live server: every operation of the OpenAPI document, with
schemathesis-generated requests (bounded: examples per operation and a time budget).

Positive cases (valid per the document) must never get a 5xx, an undocumented status or
header, or a body or content type the document does not describe, and must never be refused
for a field the document lets through (`documented_fields_accepted`: a body that refuses
unknown fields must say `additionalProperties: false`). Negative cases (invalid per the
document) must be refused with a 4xx (`negative_data_rejection`: a parameter format the
document states, such as since/until's, must be enforced). Each path's OPTIONS must list the
methods the document gives it (`allow_header_conformance`), and a request without its body
must be refused exactly when the document says the body is required."""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    allow_header_conformance,
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.api.keys_http import ADMIN_TOKEN, Admin, start_keys_server

pytestmark = pytest.mark.slow

EXAMPLES_PER_OPERATION = 12  # positive cases
NEGATIVE_PER_OPERATION = 6
BUDGET_S = 240.0  # the whole run; operations past it are skipped, never half-checked
# Error codes of a 400 that blames a field itself, not its value's meaning in context.
_FIELD_REFUSALS = {"unknown_parameter", "unsupported_parameter"}


@schemathesis.check
def documented_fields_accepted(ctx, response, case) -> bool | None:
    """A request the document calls valid is not refused for one of its fields: an unknown
    one the document lets through, or a value the document allows of a refused one."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 400:
        return None
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return None
    message = str(error.get("message"))
    if error.get("code") in _FIELD_REFUSALS or "unknown field" in message:
        raise AssertionError(
            f"A request valid per the document was refused for a field: {message}\n"
            "Document the field (or `additionalProperties: false`), or accept it."
        )
    return None


POSITIVE_CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    documented_fields_accepted,
]
NEGATIVE_CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def live(start_server, tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    url = f"sqlite+aiosqlite:///{tmp / 'tessera.db'}"
    server = start_keys_server(start_server, tiny_llama_dir, tmp, url)
    _, key = Admin(server).create_key("fuzz", rpm_limit=10**6, token_budget=10**15)
    return server, key


def _operations(server) -> list:
    schema = schemathesis.openapi.from_url(server.base_url + "/docs/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def _fuzzer(operation, mode, base_url: str, token: str, statuses: Counter, first: list):
    """A hypothesis test of one operation: generated cases, called and validated. The first
    case is kept in `first` for the probes."""
    positive = mode == GenerationMode.POSITIVE

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES_PER_OPERATION if positive else NEGATIVE_PER_OPERATION,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def run(case) -> None:
        if not first:
            first.append(case)
        response = case.call_and_validate(
            base_url=base_url,
            headers={"Authorization": f"Bearer {token}"},
            checks=POSITIVE_CHECKS if positive else NEGATIVE_CHECKS,
            timeout=60,
        )
        statuses[response.status_code] += 1

    return run


# --- probes: the path and the body as a whole, on one valid case of each operation -----------


def _probe_allow(operation, case, url: str, headers: dict[str, str]) -> None:
    """OPTIONS lists the methods the document gives the path."""
    options = httpx.options(url, headers=headers, timeout=30)
    case.validate_response(options, checks=[allow_header_conformance])


def _probe_body(operation, case, url: str, headers: dict[str, str]) -> None:
    """Without its body a request is refused exactly when the document says it is required."""
    body = operation.definition.raw.get("requestBody")
    if body is None:
        return
    bare = httpx.request(case.method, url, headers=headers, timeout=60)
    empty = bare.status_code == 400 and "body is empty" in bare.text
    required = bool(body.get("required"))
    assert empty == required, (
        f"without a body: {bare.status_code} ({bare.text[:200]}); the document says the "
        f"body is {'required' if required else 'optional'}"
    )


# Query values that slip through lenient parsing: numbers read as Unix seconds (0.5 was
# 1970-01-01T00:00:00.5Z), dates without a time or an offset, impossible dates.
_CONSTRAINTS = ("format", "minimum", "maximum", "pattern")
_SLIPS = ["0.5", "-1", "1e9", "86400", "2025-06-01", "2025-06-01T00:00:00", "2025-02-30T00:00:00Z"]


def _valid_on_the_wire(validator, value: str) -> bool:
    """Whether the document allows the query value (as a string, or as the number it spells)."""
    if validator.is_valid(value):
        return True
    try:
        number = float(value)
    except ValueError:
        return False
    return validator.is_valid(number) or (number.is_integer() and validator.is_valid(int(number)))


def _probe_formats(operation, case, url: str, headers: dict[str, str]) -> None:
    """Each query parameter with a format or bounds refuses the values the document rules out
    (random negative cases rarely spell a number where a date-time is documented)."""
    if "requestBody" in operation.definition.raw:
        return  # without its body the request is refused anyway
    for param in operation.definition.raw.get("parameters", []):
        schema = param.get("schema", {})
        text = json.dumps(schema)
        if param.get("in") != "query" or not any(f'"{k}"' in text for k in _CONSTRAINTS):
            continue
        validator = jsonschema_rs.validator_for(schema, validate_formats=True)
        for value in _SLIPS:
            if _valid_on_the_wire(validator, value):
                continue
            params = {param["name"]: value}
            r = httpx.request(case.method, url, params=params, headers=headers, timeout=30)
            assert r.status_code == 400, (
                f"?{param['name']}={value}: {r.status_code} ({r.text[:200]}); the document "
                "rules that value out"
            )


def test_every_operation_matches_its_schema(live):
    server, key = live
    started = time.monotonic()
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    checked = 0
    for operation in _operations(server):
        if time.monotonic() - started > BUDGET_S:
            break  # bounded; the operations checked so far count
        admin = operation.path.startswith("/admin") or operation.path.endswith("_lora_adapter")
        token = ADMIN_TOKEN if admin else key  # vLLM's LoRA routes: the admin token
        label = f"{operation.method.upper()} {operation.path}"
        first: list = []
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            run = _fuzzer(operation, mode, server.base_url, token, statuses, first)
            try:
                run()
            except Unsatisfiable:  # nothing to make invalid (no parameters, no body)
                assert mode == GenerationMode.NEGATIVE, label
            except (Exception, FailureGroup) as exc:  # noqa: BLE001 - collect them all
                failures.append(f"{label} ({mode.value}): {exc}")
        headers = {"Authorization": f"Bearer {token}"}
        url = server.base_url + first[0].formatted_path
        for probe in (_probe_allow, _probe_formats, _probe_body):
            try:
                probe(operation, first[0], url, headers)
            except (Exception, FailureGroup) as exc:  # noqa: BLE001
                failures.append(f"{label} ({probe.__name__}): {exc}")
        checked += 1
    assert not failures, "\n\n".join(failures)
    assert checked >= 10, checked
    print("schemathesis statuses:", dict(statuses), f"in {time.monotonic() - started:.0f} s")
    assert statuses[200] > 0 and sum(v for k, v in statuses.items() if k >= 400) > 0, statuses
