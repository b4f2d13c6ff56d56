"""Property-based API tests: schemathesis generates requests from our own ``/openapi.json``.

For every operation, ``MAX_EXAMPLES`` valid and ``MAX_EXAMPLES`` invalid requests (bounded),
sent with an admin token to the real server. Checks: no 5xx, every status code is documented,
content types match, every response body matches its schema, invalid input is rejected.

(schemathesis' own pytest plugin, ``from_fixture``, does not work with pytest 9 — it reads a
private node attribute — so the operations are driven here with hypothesis directly.)
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode, checks

from .conftest import ADMIN, close_env, make_env

MAX_EXAMPLES = 10
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance]
NEGATIVE_CHECKS = [*CHECKS, checks.negative_data_rejection]
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory: pytest.TempPathFactory):
    env = make_env(f"sqlite:///{tmp_path_factory.mktemp('schemathesis') / 'api.db'}")
    for load in (10.0, 40.0, 10.0):  # history for the list endpoints to page through
        env.tick(load)
    try:
        yield schemathesis.openapi.from_url(f"{env.url}/openapi.json")
    finally:
        close_env(env)


def _run(operation, mode: GenerationMode, check_list: list, calls: list[int]) -> list[str]:
    failures: list[str] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        calls.append(1)
        try:
            case.call_and_validate(headers=AUTH, checks=check_list, timeout=10)
        except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001 - collect every failure, report together
            failures.append(f"{operation.label} [{mode.value}]: {str(e).strip()[:1500]}")
            raise

    try:
        run()
    except (Exception, BaseExceptionGroup):  # noqa: BLE001 - recorded above (hypothesis re-raises it)
        pass
    return failures[-1:]


def test_every_operation_conforms_to_the_openapi_schema(api_schema) -> None:
    failures, operations, calls = [], 0, []
    for result in api_schema.get_all_operations():
        operation = result.ok()
        operations += 1
        failures += _run(operation, GenerationMode.POSITIVE, CHECKS, calls)
        failures += _run(operation, GenerationMode.NEGATIVE, NEGATIVE_CHECKS, calls)
    assert operations >= 20 and len(calls) >= 10 * operations, (operations, len(calls))
    print(f"schemathesis: {operations} operations, {len(calls)} requests, {len(failures)} failures")
    assert not failures, "\n\n".join(failures)
