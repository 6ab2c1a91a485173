"""The hooks that make the GDS push driver, certlm's OPC UA client certificate route and its table available."""

from __future__ import annotations

from quart import Blueprint

from certlm import DeviceDriverRegistry, HostServices, hookimpl
from certlm_gds_push.blueprint import make_blueprint
from certlm_gds_push.driver import GdsPushDriver

CERTLM_PLUGIN_API = "1.1"


@hookimpl
def certlm_register_device_drivers(register: DeviceDriverRegistry) -> None:
    register.add(GdsPushDriver)


@hookimpl
def certlm_provide_blueprints(services: HostServices) -> list[Blueprint]:
    return [make_blueprint(services)]


@hookimpl
def certlm_provide_model_modules() -> list[str]:
    return ["certlm_gds_push.models"]
