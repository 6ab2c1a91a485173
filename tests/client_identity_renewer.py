"""A certlm instance renewing its OPC UA client certificate, as a process of its own:
``python -m tests.client_identity_renewer DATABASE_URL DATA_DIR STEP``.

Opens the database as ``certlm serve`` does, with the plugins installed. ``setup`` makes internal CA 1, certlm's
client certificate from it, and internal CA 2, and prints their PKI entry ids as JSON. ``race`` reads the client
certificate, prints ``READY`` and waits for a line on stdin (the test's barrier), then renews it from CA 2 as a
campaign does (``GdsClientCertificate.renew``) and prints how many certificates it had CA 2 sign and the SHA-1 of
the one it presents then. Several started together on one PostgreSQL race for the same identity row.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from certlm_gds_push.identity import client_certificate
from cryptography import x509

from certlm.contracts.enrollment import CLIENT_PROFILE, Enrollment
from certlm.foundation.certs import sha1_fingerprint
from certlm.http.app import create_app
from certlm.storage import close_storage, open_storage
from certlm.storage.models import PkiEntry
from certlm.testing.in_process import in_process_settings


async def main(database_url: str, data_dir: str, step: str) -> None:
    settings = in_process_settings(Path(data_dir), database_url=database_url)
    host = create_app(settings).extensions["certlm"]
    await open_storage(database_url, host.model_modules, host.plugin_migrations)
    holder = client_certificate(host.services)
    try:
        if step == "setup":
            ca1 = await PkiEntry.create(name="CA 1", pki_type=1, pki_connection="localhost:0")
            await holder.identity()
            ca2 = await PkiEntry.create(name="CA 2", pki_type=1, pki_connection="localhost:0")
            print(json.dumps({"ca1": ca1.id, "ca2": ca2.id}))
            return
        ca2 = await PkiEntry.get(name="CA 2")
        backend = host.pki_backends.get(ca2.pki_type)
        presented = await holder.presented()
        assert presented is not None
        issued = 0

        async def issue(csr: x509.CertificateSigningRequest) -> Enrollment:
            nonlocal issued
            issued += 1
            return await backend.enroll(ca2, csr, CLIENT_PROFILE)

        print("READY", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        renewed = await holder.renew(issue, presented.certificate)
        identity = await holder.identity()
        assert identity.certificate == renewed.certificate, "the instance presents what it renewed to"
        print(json.dumps({"issued": issued, "sha1": sha1_fingerprint(renewed.certificate)}))
    finally:
        await close_storage()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
