"""PKI type 0, ``none``: an entry without a PKI. Devices keep the certificates they have."""

from __future__ import annotations

from certlm import PkiBackend, PkiBackendRegistry, hookimpl

CERTLM_PLUGIN_API = "1.0"


class NoPki(PkiBackend):
    pki_type = 0
    name = "none"


@hookimpl(trylast=True)
def certlm_register_pki_backends(register: PkiBackendRegistry) -> None:
    register.add(NoPki)
