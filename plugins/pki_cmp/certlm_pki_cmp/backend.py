"""PKI type 3 (placeholder until the client lands)."""

from __future__ import annotations

from certlm.registry import PkiBackend


class CmpPki(PkiBackend):
    pki_type = 3
    name = "cmp"
