"""The Widget as the simulator plays it: an ACME Widget PLC 3000 with firmware 2.5 and the Widget's quirks."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

# What the Widget says about itself (OPC UA BuildInfo), and how it behaves: no key generator, answering
# CreateSigningRequest with BadInternalError; private keys only as PEM; the simulator is as strict as real devices
# by default, so it wants the trust list before the certificate.
WIDGET = {
    "manufacturer": "ACME",
    "product": "Widget PLC 3000",
    "firmware": "2.5",
    "fail_at": "create_signing_request:BadInternalError",
    "private_key_formats": ("PEM",),
}

StartWidget = Callable[..., Awaitable[Any]]


@pytest.fixture
def start_widget(certlm_simulated_device: Callable[..., Awaitable[Any]]) -> StartWidget:
    """Starts simulated Widgets in their factory state: ``await start_widget(firmware="3.0")`` changes what the
    Widget is like (``SimulatorConfig`` fields)."""

    async def start(**changes: Any) -> Any:
        return await certlm_simulated_device(**{**WIDGET, **changes})

    return start


@pytest.fixture
async def widget(start_widget: StartWidget) -> Any:
    """A simulated Widget PLC 3000, firmware 2.5, on 127.0.0.1."""
    return await start_widget()
