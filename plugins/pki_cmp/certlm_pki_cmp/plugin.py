"""The hook that makes the CMP client available as PKI type 3."""

from __future__ import annotations

from certlm import hookimpl
from certlm.contracts.registry import PkiBackendRegistry


@hookimpl
def certlm_register_pki_backends(register: PkiBackendRegistry) -> None:
    from certlm_pki_cmp.backend import CmpPki

    register.add(CmpPki)
