"""The hooks that make the internal CA available as PKI type 1 and store its tables in the host's database."""

from __future__ import annotations

from certlm import PkiBackendRegistry, hookimpl
from certlm_pki_internal.backend import InternalPki

CERTLM_PLUGIN_API = "1.1"


@hookimpl
def certlm_register_pki_backends(register: PkiBackendRegistry) -> None:
    register.add(InternalPki)


@hookimpl
def certlm_provide_model_modules() -> list[str]:
    return ["certlm_pki_internal.models"]
