"""The hook that makes the CMP client available as PKI type 3."""

from __future__ import annotations

from certlm import PkiBackendRegistry, hookimpl

CERTLM_PLUGIN_API = "1.0"


@hookimpl
def certlm_register_pki_backends(register: PkiBackendRegistry) -> None:
    from certlm_pki_cmp.backend import CmpPki

    register.add(CmpPki)
