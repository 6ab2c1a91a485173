"""What certlm learns about a CMP server by using it: which message types it accepts and which it refuses, kept in
``PkiEntry.learned_capabilities`` so that the next enrollment goes straight to what works.

Stored under the key ``cmp`` and shown as ``learned_capabilities`` in ``GET /pki/inventory/{pki_id}`` (CMP has no
validate endpoint: this is where an operator sees what the server took)::

    {"cmp": {"endpoint": "http://ca.plant.local:8080/pkix/",
             "genm": {"accepted": false, "at": "2025-05-02T09:14:03Z", "answer": "HTTP 500: Server Error (500)"},
             "p10cr": {"accepted": false, "at": "2025-05-02T09:14:03Z", "answer": "badRequest (unsupported pkibody)"},
             "ir": {"accepted": true, "at": "2025-05-02T09:14:04Z"}}}

One key per message type certlm sent (``genm`` standing for the genm asking for id-it-caCerts): ``accepted``, when
that was learned (``at``, UTC), and for a refusal the server's answer (bounded, sanitised; ``(unprotected answer)``
marks a CMP error message without protection). ``endpoint`` is the CMP endpoint the lessons are about.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from certlm import pki_client
from certlm.storage.models import PkiEntry
from certlm_pki_cmp import messages
from certlm_pki_cmp.transaction import ServerRefused
from certlm_pki_cmp.transport import HttpErrorAnswer, endpoint_url

# A learned refusal is skipped for this long, then the type is asked again, so that a server upgrade is noticed
# within a day. A server that still refuses costs one refused request a day per type. Not asking at all would miss
# the upgrade for good; asking every time would send genm to the CA on every GET /pki/ca, which is open to anyone.
REFUSAL_LIFETIME = timedelta(days=1)

# What counts as the server refusing a message *type* (learned, and certlm's next option tried) rather than this
# request (a real error, reported at once):
#
# - An HTTP error status without a CMP message (RFC 6712 §3.3 allows any 4xx or 5xx) that says the server could not
#   process this body: 400, 422, 500 or 501. The Django server of issue 10 answers an unsupported genm with 500.
#   Not 401, 403 or 407 (HTTP authentication: credentials), 404, 405 or 415 (the path, method or content type: every
#   message type fails alike, a configuration error), 408, 429, 502, 503 or 504 (the server or a proxy is busy or
#   down: nothing is learned about the type).
REFUSING_HTTP_STATUSES = frozenset({400, 422, 500, 501})
# - A CMP rejection, in an error message or as the status of the ip/cp/kup answering the request, whose failInfo
#   names badRequest ("transaction not permitted or supported", RFC 4210 §5.2.3) or badDataFormat (a body the server
#   cannot parse) and nothing else. RFC 9483 has no failInfo of its own for a body type a server does not implement;
#   OpenSSL's server answers one with an error message carrying badRequest (crypto/cmp/cmp_server.c,
#   CMP_R_UNSUPPORTED_PKIBODY). Any other bit puts the blame elsewhere and makes a real error: badMessageCheck,
#   wrongIntegrity, signerNotTrusted (the protection or credentials, RFC 9483 §3.5), notAuthorized (this sender may
#   not do this, §3.5: a matter of who, not of the type), badPOP, badCertTemplate, badCertId, unacceptedPolicy, ...
#   (the request's content), systemUnavail, systemFailure (the server is not working: nothing to learn). A rejection
#   without failInfo does not say why and is a real error too.
TYPE_REFUSAL_FAILURES = frozenset({"badRequest", "badDataFormat"})
# OpenSSL's server also says badRequest for much else it cannot process, an untrusted signer included, so a refusal
# may be learned that is not one. That costs little: certlm tries its next option, retries a learned refusal when no
# other option is left, forgets it after REFUSAL_LIFETIME, and every error lists the server's own words per type.
#
# An unprotected CMP error message counts like an HTTP error answer: anyone on the path could have sent either, and
# the most they achieve is that certlm tries another request type, every one of them protected (certlm never accepts
# an unprotected certificate), or fails, which dropping the connection achieves too.


class TypeRefused(Exception):
    """The server refused a message type (by the rule above): ``kind`` and ``answer``, the server's words."""

    def __init__(self, kind: str, answer: str) -> None:
        super().__init__(f"{kind}: {answer}")
        self.kind = kind
        self.answer = answer


def type_refusal(error: ServerRefused | HttpErrorAnswer) -> str | None:
    """The answer to record when ``error`` says the server does not take the request's message type; None when it
    is a real error of this request."""
    if isinstance(error, HttpErrorAnswer):
        return error.answer if error.status_code in REFUSING_HTTP_STATUSES else None
    failures = set(error.status.failures)
    if error.status.status != messages.REJECTION or not failures or not failures <= TYPE_REFUSAL_FAILURES:
        return None
    said = replace(error.status, text=pki_client.answer_text(error.status.text)).describe()
    return said + ("" if error.verified else " (unprotected answer)")


def _now() -> datetime:
    return datetime.now(UTC)


def _timestamp(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _moment(value: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None


@dataclass
class LearnedCapabilities:
    """The lessons about one entry's CMP endpoint, changed in memory and written back by ``save``."""

    endpoint: str
    types: dict[str, dict[str, Any]] = field(default_factory=dict)
    changed: bool = False

    @classmethod
    def of(cls, entry: PkiEntry) -> LearnedCapabilities:
        """What the entry holds about its current endpoint. Lessons about another endpoint (``pki_connection`` or
        ``additional_path_segment`` changed since) are dropped: a new server, or the same one moved or upgraded,
        is learned afresh."""
        endpoint = endpoint_url(entry)
        stored = (entry.learned_capabilities or {}).get("cmp")
        if not isinstance(stored, dict) or stored.get("endpoint") != endpoint:
            return cls(endpoint, changed=isinstance(stored, dict))
        types = {kind: dict(value) for kind, value in stored.items() if kind != "endpoint" and isinstance(value, dict)}
        return cls(endpoint, types)

    def refusal(self, kind: str, now: datetime | None = None) -> dict[str, Any] | None:
        """The refusal of ``kind`` learned within ``REFUSAL_LIFETIME``, else None."""
        lesson = self.types.get(kind)
        if lesson is None or lesson.get("accepted") is not False:
            return None
        learned_at = _moment(lesson.get("at"))
        if learned_at is None or learned_at + REFUSAL_LIFETIME <= (now or _now()):
            return None
        return lesson

    def accepted(self, kind: str) -> None:
        # Written when it changes only: an enrollment that goes as the last one did writes nothing.
        if self.types.get(kind, {}).get("accepted") is not True:
            self.types[kind] = {"accepted": True, "at": _timestamp(_now())}
            self.changed = True

    def refused(self, kind: str, answer: str) -> None:
        self.types[kind] = {"accepted": False, "at": _timestamp(_now()), "answer": answer}
        self.changed = True

    async def save(self, entry: PkiEntry) -> None:
        """Write the lessons to the entry when they changed. Two enrollments through one entry at once may each
        write theirs, the last one winning: a lesson lost is learned again on the next enrollment."""
        if not self.changed:
            return
        entry.learned_capabilities = {
            **(entry.learned_capabilities or {}),
            "cmp": {"endpoint": self.endpoint, **self.types},
        }
        await entry.save(update_fields=["learned_capabilities", "updated_at"])
        self.changed = False
