"""The hooks that hand the Widget's driver and ACME's key vault to certlm: the module this distribution's ``certlm``
entry point names."""

from __future__ import annotations

from certlm import DeviceDriverRegistry, PkiBackendRegistry, hookimpl

from certlm_acme_widget.driver import AcmeWidgetDriver
from certlm_acme_widget.key_vault import AcmeKeyVaultPki

CERTLM_PLUGIN_API = "1.0"


@hookimpl
def certlm_register_device_drivers(register: DeviceDriverRegistry) -> None:
    register.add(AcmeWidgetDriver)


@hookimpl
def certlm_register_pki_backends(register: PkiBackendRegistry) -> None:
    register.add(AcmeKeyVaultPki)
