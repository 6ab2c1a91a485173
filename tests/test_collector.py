"""``certlm serve`` runs CPython's garbage collector on a young generation of 5,000 objects rather than 700
(``certlm.http.server.COLLECTOR_THRESHOLDS``), and ``GET /metrics`` counts its runs by generation."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from certlm.testing import RunningService

# A rename makes some 80 objects the collector tracks that outlive it a while: at CPython's 700 about 28 young
# collections in this many, at 5,000 about 4.
RENAMES = 240


async def collections(api: httpx.AsyncClient) -> dict[str, float]:
    answer = await api.get("/metrics")
    assert answer.status_code == 200, answer.text
    found = {
        sample.labels["generation"]: sample.value
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
        if sample.name == "python_gc_collections_total"
    }
    assert set(found) == {"0", "1", "2"}, found
    return found


async def test_the_collector_runs_rarely_and_metrics_count_its_runs(certlm_service: RunningService) -> None:
    async with certlm_service.client() as api:
        device = {"server": "127.0.0.1", "port": 4870}
        answer = await api.post("/gds/inventory", json=device)
        assert answer.status_code == 200, answer.text
        before = await collections(api)
        for n in range(RENAMES):
            answer = await api.patch("/gds/inventory", json={**device, "name": f"press {n}"})
            assert answer.status_code == 200, answer.text
        after = await collections(api)
    young_collections = after["0"] - before["0"]
    assert 0 < young_collections <= RENAMES / 30, (before, after)
