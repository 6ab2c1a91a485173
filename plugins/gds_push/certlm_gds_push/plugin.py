"""The hooks that make the GDS push driver, certlm's OPC UA client certificate (its route, its renewal by campaigns)
and its table available."""

from __future__ import annotations

from quart import Blueprint

from certlm import ClientCertificateHolder, DeviceDriverRegistry, HostServices, hookimpl
from certlm_gds_push.blueprint import make_blueprint
from certlm_gds_push.driver import GdsPushDriver
from certlm_gds_push.identity import client_certificate

CERTLM_PLUGIN_API = "1.1"


@hookimpl
def certlm_register_device_drivers(register: DeviceDriverRegistry) -> None:
    register.add(GdsPushDriver)


@hookimpl
def certlm_provide_blueprints(services: HostServices) -> list[Blueprint]:
    return [make_blueprint(services)]


@hookimpl
def certlm_provide_client_certificates(services: HostServices) -> list[ClientCertificateHolder]:
    return [client_certificate(services)]


@hookimpl
def certlm_provide_model_modules() -> list[str]:
    return ["certlm_gds_push.models"]
