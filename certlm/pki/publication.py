"""What the open routes ``GET /pki/ca`` and ``GET /pki/crl`` publish to anyone, without an API key.

An anonymous caller must not be able to make certlm talk to a PKI on an entry's credentials, nor learn how an entry
is set up. So the CA certificates served are only those certlm holds (``PkiBackend.published_ca_certificates``), and
the CRL is fetched only as the spec asks, from CRL distribution points, then kept until its nextUpdate so that
repeated calls cost one fetch. A failed fetch is kept for ``FAILURE_REUSE`` as well: hammering the route costs the
distribution points nothing more. The texts these answer name no setting; the reasons go to the log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography import x509

from certlm.contracts.pki_backends import PkiBackend
from certlm.contracts.registry import PkiBackendRegistry
from certlm.foundation.errors import APIError, NotFound, UnsupportedOperation, UpstreamUnavailable
from certlm.storage.models import PkiEntry

log = logging.getLogger(__name__)

# A CRL is kept until its nextUpdate, but never longer than this: a CA may publish early (after a revocation).
LONGEST_REUSE = timedelta(hours=1)
# How long an answer without a usable nextUpdate, or a failure, is reused.
FAILURE_REUSE = timedelta(seconds=60)


def no_ca_text(pki_id: int) -> str:
    return f"No CA available for PKI entry {pki_id}"


def no_crl_text(pki_id: int) -> str:
    return f"No CRL available for PKI entry {pki_id}"


def no_distribution_point_text(pki_id: int) -> str:
    return f"No CRL distribution point available for PKI entry {pki_id}"


def unreachable_crl_text(pki_id: int) -> str:
    return f"No CRL could be downloaded for PKI entry {pki_id}: no CRL distribution point delivered one"


async def published_ca_certificates(entry: PkiEntry, backends: PkiBackendRegistry) -> list[x509.Certificate]:
    """The CA chain certlm holds for ``entry``, issuing CA first; ``NotFound`` (a text naming no setting) when none,
    or when no installed plugin provides the entry's PKI type."""
    try:
        certificates = await backends.get(entry.pki_type).published_ca_certificates(entry)
    except APIError as error:
        log.info("GET /pki/ca/%s: no CA certificates: %s", entry.id, error.message)
        certificates = []
    if not certificates:
        raise NotFound(no_ca_text(entry.id))
    return certificates


@dataclass
class _Published:
    updated_at: datetime | None
    expires: datetime
    crl: x509.CertificateRevocationList | None
    error: APIError | None


class PublishedCrls:
    """Each PKI entry's CRL as ``GET /pki/crl`` serves it, or the error it answers, until it should be fetched again.
    An entry changed since (its ``updated_at``) is fetched again. One fetch per entry at a time. A backend whose CRL
    is local (``crl_is_local``) is asked every time: it fetches nothing, and knows its revocations at once."""

    def __init__(self, clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.clock = clock
        self._published: dict[int, _Published] = {}
        self._locks: dict[int, asyncio.Lock] = {}

    async def crl(self, entry: PkiEntry, backends: PkiBackendRegistry) -> x509.CertificateRevocationList:
        if not backends.known(entry.pki_type):
            raise NotFound(no_crl_text(entry.id))
        backend = backends.get(entry.pki_type)
        if backend.crl_is_local:
            published = await self._fetch(entry, backend, self.clock())
        else:
            async with self._locks.setdefault(entry.id, asyncio.Lock()):
                published = self._published.get(entry.id)
                now = self.clock()
                if published is None or published.updated_at != entry.updated_at or now >= published.expires:
                    published = await self._fetch(entry, backend, now)
                    self._published[entry.id] = published
        if published.error is not None:
            raise published.error
        assert published.crl is not None
        return published.crl

    @staticmethod
    async def _fetch(entry: PkiEntry, backend: PkiBackend, now: datetime) -> _Published:
        failed_until = now + FAILURE_REUSE
        try:
            crl = await backend.crl(entry)
        except UnsupportedOperation as error:
            log.info("GET /pki/crl/%s: %s", entry.id, error.message)
            return _Published(entry.updated_at, failed_until, None, NotFound(no_crl_text(entry.id)))
        except NotFound as error:
            log.info("GET /pki/crl/%s: no CRL distribution point: %s", entry.id, error.message)
            return _Published(entry.updated_at, failed_until, None, NotFound(no_distribution_point_text(entry.id)))
        except APIError as error:
            log.warning("GET /pki/crl/%s: no CRL could be downloaded: %s", entry.id, error.message)
            return _Published(entry.updated_at, failed_until, None, UpstreamUnavailable(unreachable_crl_text(entry.id)))
        next_update = crl.next_update_utc
        expires = min(next_update, now + LONGEST_REUSE) if next_update and next_update > now else failed_until
        return _Published(entry.updated_at, expires, crl, None)
