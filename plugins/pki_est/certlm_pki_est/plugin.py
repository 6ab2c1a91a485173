"""The hook that makes the EST client available as PKI type 2."""

from __future__ import annotations

from certlm import PkiBackendRegistry, hookimpl

CERTLM_PLUGIN_API = "1.0"


@hookimpl
def certlm_register_pki_backends(register: PkiBackendRegistry) -> None:
    from certlm_pki_est.backend import EstPki

    register.add(EstPki)
