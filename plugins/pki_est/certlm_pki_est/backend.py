"""PKI type 2 (placeholder until the client lands)."""

from __future__ import annotations

from certlm.registry import PkiBackend


class EstPki(PkiBackend):
    pki_type = 2
    name = "est"
