"""Property-based fuzzing of the server's own OpenAPI schema: no 5xx, no crash, bounded in time."""

from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.server_utils import ServerProcess

pytestmark = pytest.mark.slow

TIME_BUDGET_S = 60.0
EXAMPLES_PER_OPERATION = 25


def test_openapi_fuzz_finds_no_server_error(tiny_models):
    # A small max_tokens limit keeps each generated request short; larger asks must get a 400, not a 5xx.
    srv = ServerProcess(tiny_models["qwen2"], "--dtype", "float32", "--max-tokens-limit", "8",
                        "--max-queued-requests", "1000")
    try:
        spec = httpx.get(srv.url + "/openapi.json").json()
        schema = schemathesis.openapi.from_dict(spec)
        deadline = time.monotonic() + TIME_BUDGET_S
        seen = []
        for result in schema.get_all_operations():
            operation = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                strategy = operation.as_strategy(generation_mode=mode)

                @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(data=st.data())
                def run(data):
                    if time.monotonic() > deadline:
                        return
                    case = data.draw(strategy)
                    response = case.call(base_url=srv.url, timeout=30)
                    seen.append(response.status_code)
                    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])
                    if response.status_code >= 400:
                        assert "error" in response.json(), response.text[:300]

                try:
                    run()
                except Unsatisfiable:  # nothing to negate (an operation without inputs)
                    assert mode == GenerationMode.NEGATIVE
        assert srv.proc.poll() is None, "the server died while being fuzzed"
        assert httpx.get(srv.url + "/health").status_code == 200
        assert len(seen) > 50 and any(s == 200 for s in seen) and any(400 <= s < 500 for s in seen)
    finally:
        assert srv.stop() == 0
