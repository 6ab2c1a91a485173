"""What certlm learns about a CMP server by using it: which message types it accepts and which it refuses, and which
MAC identifiers it takes, kept in ``PkiEntry.learned_capabilities`` so that the next enrollment goes straight to what
works.

Stored under the key ``cmp`` and shown as ``learned_capabilities`` in ``GET /pki/inventory/{pki_id}`` (CMP has no
validate endpoint: this is where an operator sees what the server took)::

    {"cmp": {"endpoint": "http://ca.plant.local:8080/pkix/",
             "mac_algorithm": {"name": "rfc4210-hmac-sha1", "owf": "2.16.840.1.101.3.4.2.1",
                               "mac": "1.3.6.1.5.5.8.1.2", "at": "2025-05-02T09:14:04+00:00",
                               "refused": {"rfc9481-hmac-sha256": "rejection (CMP shared secret authentication
                                           failed: hmac algorithm not supported.) (protection does not verify)"}},
             "genm": {"accepted": false, "at": "2025-05-02T09:14:03+00:00", "answer": "HTTP 500: Server Error (500)"},
             "p10cr": {"accepted": false, "at": "2025-05-02T09:14:03+00:00",
                       "answer": "badRequest (unsupported pkibody)"},
             "ir": {"accepted": true, "at": "2025-05-02T09:14:04+00:00"}}}

One key per message type certlm sent (``genm`` standing for the genm asking for id-it-caCerts): ``accepted``, when
that was learned (``at``, UTC), and for a refusal the server's answer (bounded, sanitised; ``(unprotected answer)``
marks a CMP error message without protection, ``(protection does not verify)`` one certlm cannot verify).
``mac_algorithm`` names the PasswordBasedMac identifiers (``protection.MAC_ALGORITHMS``) a verified answer showed the
server to take, by name and OIDs, with what it answered to those it rejected before (``transaction.MacNegotiation``):
MAC-protected requests use them first, and no other. ``endpoint`` is the CMP endpoint the lessons are about.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from certlm import PkiEntry, api_timestamp
from certlm_pki_cmp import messages
from certlm_pki_cmp.protection import MAC_ALGORITHMS, MacAlgorithm
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
#
# An error message protected so that certlm cannot verify it, from a server known to verify certlm's protection
# (signed requests, or MAC identifiers it took before), refuses the type whatever it says: Trustpoint 0.6 signs such
# answers with a key of its own, and a server that cannot be understood is refused like one that answers HTTP 500.
# While the MAC identifiers are not known to work, such an answer rejects the protection (``MacNegotiation``).


# The key of the MAC lesson next to the message types.
MAC_LESSON = "mac_algorithm"


class TypeRefused(Exception):
    """The server refused a message type (by the rule above): ``kind`` and ``answer``, the server's words."""

    def __init__(self, kind: str, answer: str) -> None:
        super().__init__(f"{kind}: {answer}")
        self.kind = kind
        self.answer = answer


def type_refusal(error: ServerRefused | HttpErrorAnswer, protection_known: bool = True) -> str | None:
    """The answer to record when ``error`` says the server does not take the request's message type; None when it
    is a real error of this request. ``protection_known``: the server is known to verify certlm's protection."""
    if isinstance(error, HttpErrorAnswer):
        return error.answer if error.status_code in REFUSING_HTTP_STATUSES else None
    if error.protection_failure is not None:
        return error.said if protection_known else None
    failures = set(error.status.failures)
    if error.status.status != messages.REJECTION or not failures or not failures <= TYPE_REFUSAL_FAILURES:
        return None
    return error.said


def _now() -> datetime:
    return datetime.now(UTC)


def _timestamp(moment: datetime) -> str:
    return api_timestamp(moment.astimezone(UTC))


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
    mac: dict[str, Any] = field(default_factory=dict)
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
        types = {
            kind: dict(value)
            for kind, value in stored.items()
            if kind not in ("endpoint", MAC_LESSON) and isinstance(value, dict)
        }
        mac = stored.get(MAC_LESSON)
        return cls(endpoint, types, dict(mac) if isinstance(mac, dict) else {})

    def mac_algorithm(self) -> MacAlgorithm | None:
        """The MAC identifiers the server was seen to take, if any."""
        return MAC_ALGORITHMS.get(str(self.mac.get("name")))

    def mac_worked(self, algorithm: MacAlgorithm, refused: dict[str, str]) -> None:
        """The server verified requests under ``algorithm``, having answered ``refused`` to other identifiers."""
        if self.mac.get("name") == algorithm.name and not refused:
            return
        self.mac = {"name": algorithm.name, "owf": algorithm.owf, "mac": algorithm.mac, "at": _timestamp(_now())}
        if refused:
            self.mac["refused"] = dict(refused)
        self.changed = True

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
        lessons: dict[str, Any] = {"endpoint": self.endpoint}
        if self.mac:
            lessons[MAC_LESSON] = self.mac
        entry.learned_capabilities = {**(entry.learned_capabilities or {}), "cmp": {**lessons, **self.types}}
        await entry.save(update_fields=["learned_capabilities", "updated_at"])
        self.changed = False
