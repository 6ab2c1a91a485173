"""The plugin in a real ``certlm serve``: found through its installed entry point, and enrolling a Widget."""

from __future__ import annotations

from typing import Any

import httpx
from certlm.testing import assert_pushed, create_internal_ca, push


async def test_a_running_certlm_finds_the_plugin_and_enrolls_a_widget(
    certlm_api: httpx.AsyncClient, widget: Any
) -> None:
    services = {row["service"] for row in (await certlm_api.get("/supported-devices")).json()}
    assert "gds-push-acme-widget" in services
    ca = await create_internal_ca(certlm_api)
    outcome = await push(certlm_api, widget)
    assert outcome["result"]["service"] == "gds-push-acme-widget"
    await assert_pushed(outcome, widget, issuer=ca.certificate)
