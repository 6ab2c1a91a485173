"""ACME's key vault as a PKI backend of its own type number (101): a vendor's PKI is registered like a device driver.

The vault hands out its CA certificate, which the operator configures in the PKI entry's ``tls_ca``; it signs
nothing through certlm yet, so every operation it leaves alone (enrollment, CRL, revocation) answers 501.
"""

from __future__ import annotations

from certlm import PkiBackend, PkiEntry, load_certificates_pem
from cryptography import x509


class AcmeKeyVaultPki(PkiBackend):
    pki_type = 101
    name = "acme-keyvault"

    def configuration_problems(self, entry: PkiEntry) -> list[str]:
        return [] if entry.tls_ca else ["an acme-keyvault entry needs its CA certificate in tls_ca"]

    async def ca_certificates(self, entry: PkiEntry) -> list[x509.Certificate]:
        return [certificate for pem in entry.tls_ca for certificate in load_certificates_pem(pem)]

    async def published_ca_certificates(self, entry: PkiEntry) -> list[x509.Certificate]:
        # The CA is part of the entry's configuration: the open GET /pki/ca may serve it, as it contacts nothing.
        return await self.ca_certificates(entry)
