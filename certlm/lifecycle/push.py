"""Enrolling a device's certificate: the entry's driver talks to the device, its PKI backend signs, the inventory
keeps what the device ended up with. The REST push endpoints and (later) the renewal scheduler both come here.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from itertools import pairwise
from typing import Any, TypeVar

from cryptography import x509

from certlm.contracts.drivers import (
    DeviceDescription,
    DeviceDriver,
    DeviceIdentity,
    DeviceIdentityChanged,
    DeviceTarget,
    PkiMaterial,
    PushFailed,
    PushOptions,
    PushOutcome,
    PushRequest,
    StepOutcome,
    TrustList,
)
from certlm.contracts.pki_backends import (
    SERVER_PROFILE,
    CertificateProfile,
    ChainCrls,
    Enrollment,
    KeyedEnrollment,
    PkiBackend,
)
from certlm.foundation import crl_status
from certlm.foundation.certs import (
    SubjectName,
    api_now,
    certificate_detail,
    crl_signed_by,
    general_name_text,
    host_general_name,
    issued_by,
    issuer_chain,
    missing_names,
    required_names,
    serial_hex,
    sha1_fingerprint,
    subject_alternative_names,
    to_der,
)
from certlm.foundation.errors import (
    APIError,
    CsrRejected,
    NotFound,
    UnsupportedOperation,
    UpstreamUnavailable,
)
from certlm.inventory.entries import create_entry, device_entry_at, device_target, entry_url, save_credentials
from certlm.inventory.identity import identity_repinned, mark_identity_changed
from certlm.lifecycle.leases import EntryDeleted, device_lease
from certlm.pki.client import cdp_urls, fetch_crl
from certlm.pki.revocation import RevocationCheck, crl_cache, store_revocation
from certlm.service.host import current_host
from certlm.storage.models import DeviceSchedule, InventoryEntry, PkiEntry

log = logging.getLogger(__name__)
EnrollmentType = TypeVar("EnrollmentType", bound=Enrollment)
Description = TypeVar("Description")


@dataclass(frozen=True)
class PushOrder(PushOptions):
    """What one push call asks for: what it asks of the device (``PushOptions``), and how the host runs and records
    it. Credentials given here are tried and stored once the device accepted them."""

    debug: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    trigger: str = "operator"
    """What asked for it, as the recorded result names it: the REST call (``POST /gds/push``) or a scheduler."""
    automated: bool = False
    """Set by the schedulers. An automated push never trusts a device on first contact: an entry without a pinned
    certificate waits for an operator."""

    @property
    def operation(self) -> str:
        """The record it is filed under: the last push and the last onboarding are answered separately."""
        return ONBOARDING if self.onboarding else PUSH


PUSH = "push"
ONBOARDING = "onboarding"


class PushError(APIError):
    """A push that did not complete; the body carries the steps it got through."""


def trust_list_record(trust_list: TrustList) -> dict[str, list[str]]:
    """A trust list as ``InventoryEntry.trustlist`` stores it (the spec's Trust list entry keys, base64 DER)."""

    def encoded(items: list[bytes]) -> list[str]:
        return [base64.b64encode(item).decode() for item in items]

    return {
        "trustlist_trusted_ca": encoded(trust_list.trusted_certificates),
        "trustlist_trusted_crl": encoded(trust_list.trusted_crls),
        "trustlist_issuer_ca": encoded(trust_list.issuer_certificates),
        "trustlist_issuer_crl": encoded(trust_list.issuer_crls),
    }


def record_operation(entry: InventoryEntry, operation: str, record: dict[str, Any]) -> None:
    """File ``record`` as the last outcome of ``operation`` in ``entry.last_result``; the caller saves the entry."""
    records = dict(entry.last_result) if isinstance(entry.last_result, dict) else {}
    records[operation] = record
    entry.last_result = records


def last_recorded(entry: InventoryEntry, operation: str) -> dict[str, Any] | None:
    """The last outcome of ``operation`` recorded for ``entry``, or None."""
    records = entry.last_result if isinstance(entry.last_result, dict) else {}
    return records.get(operation)


def description_record(description: DeviceDescription) -> dict[str, Any]:
    return {"identity": asdict(description.identity), "capabilities": description.capabilities}


def _warnings(steps: list[StepOutcome]) -> list[str]:
    """What a push noticed that an operator should know, success or not: the messages of its warning steps."""
    return [step.message for step in steps if step.warning]


def _steps_view(steps: list[StepOutcome], debug: bool) -> list[dict[str, Any]]:
    """Each step's outcome; ``debug`` adds how long it took."""
    view = []
    for step in steps:
        item: dict[str, Any] = {"step": step.step, "ok": step.ok, "status": step.status, "message": step.message}
        if step.warning:
            item["warning"] = True
        if debug:
            item["seconds"] = round(step.seconds, 4)
        view.append(item)
    return view


def _certificate_summary(certificate: x509.Certificate) -> dict[str, Any]:
    detail = certificate_detail(certificate)
    keys = ("subject_dn", "issuer_dn", "serial_number", "valid_from", "valid_to", "sha1_thumbprint")
    return {key: detail[key] for key in keys}


async def enrollment_pki(entry: InventoryEntry) -> PkiEntry:
    """The PKI entry that signs for ``entry``: its own, else the oldest PKI entry whose backend can enroll (then
    assigned to ``entry``, and stored with it when the push succeeds, so renewals keep using it)."""
    host = current_host()
    if entry.pki_id is not None:  # type: ignore[attr-defined]
        return await PkiEntry.get(id=entry.pki_id)  # type: ignore[attr-defined]
    for candidate in await PkiEntry.all().order_by("id"):
        if host.pki_backends.known(candidate.pki_type) and _can_enroll(host.pki_backends.get(candidate.pki_type)):
            entry.pki_id = candidate.id  # type: ignore[attr-defined]
            return candidate
    raise APIError(
        f"no PKI endpoint can sign for {entry.server}:{entry.port}: create one with POST /pki/inventory "
        "or assign one with PATCH /gds/inventory {pki}"
    )


def _can_enroll(backend: PkiBackend) -> bool:
    return backend.offers("enroll")


async def pki_ca_certificates(backend: PkiBackend, pki: PkiEntry) -> tuple[x509.Certificate, ...]:
    """The PKI's CA chain for a device's trust list. A PKI that hands its chain out only with an enrollment gives an
    empty tuple and the enrollment's chain is used. A PKI reached over the network that was never validated is
    validated now only when its server can be verified (``tls_ca``): CA certificates fetched over an unverified
    connection would become every device's trust anchors, so that first fetch is the operator's, who compares the
    fingerprints validate shows."""
    try:
        return tuple(await backend.ca_certificates(pki))
    except NotFound:
        if not backend.offers("validate"):
            return ()
        if not pki.tls_ca:
            raise APIError(
                f"PKI entry {pki.id} has no validated CA certificates: run GET /pki/exec/validate/{pki.id} and "
                "compare its ca_fingerprints with the PKI's, or set tls_ca so that certlm can fetch them itself"
            ) from None
    await backend.validate(pki, strict=False)
    return tuple(await backend.ca_certificates(pki))


def current_certificate_from(
    entry: InventoryEntry, ca_certificates: tuple[x509.Certificate, ...]
) -> x509.Certificate | None:
    """The device's current certificate when one of ``ca_certificates`` issued it: what the PKI renews, or revokes."""
    if not entry.certificate_der or not ca_certificates:
        return None
    current = x509.load_der_x509_certificate(entry.certificate_der)
    return current if any(issued_by(current, issuer) for issuer in ca_certificates) else None


async def pki_material(pki: PkiEntry, entry: InventoryEntry) -> PkiMaterial:
    """The enrollment callables and what the device must trust afterwards: the PKI's CA chain and current CRL.
    Certificates are requested under the server profile, naming the host certlm reaches the device at; a device
    whose current certificate came from this PKI is renewed."""
    backend = current_host().pki_backends.get(pki.pki_type)
    ca_certificates = await pki_ca_certificates(backend, pki)
    crls: tuple[x509.CertificateRevocationList, ...] = ()
    try:
        crls = (await backend.crl(pki),)
    except (NotFound, UnsupportedOperation, UpstreamUnavailable) as error:
        # A trust list without the CA's CRL still works on devices that do not insist on revocation checks;
        # the push result says why it is missing.
        log.warning("PKI entry %s: no CRL for the trust list: %s", pki.id, error.message)

    profile = replace(SERVER_PROFILE, hosts=(entry.server,))
    renewing = current_certificate_from(entry, ca_certificates)

    async def enroll(csr: x509.CertificateSigningRequest, private_key: Any = None) -> Enrollment:
        enrollment = await backend.enroll(pki, csr, profile, renewing=renewing, private_key=private_key)
        return await with_requested_names_checked(pki, backend, csr, profile, enrollment)

    async def enroll_server_key(csr: x509.CertificateSigningRequest) -> KeyedEnrollment:
        enrollment = await backend.enroll_server_key(pki, csr, profile, renewing=renewing)
        return await with_requested_names_checked(pki, backend, csr, profile, enrollment)

    async def chain_crls(enrollment: Enrollment) -> ChainCrls:
        return await crls_of_chain(enrollment, (*enrollment.chain, *ca_certificates), crls)

    return PkiMaterial(
        enroll=enroll,
        ca_certificates=ca_certificates,
        crls=crls,
        enroll_server_key=enroll_server_key if backend.offers("enroll_server_key") else None,
        chain_crls=chain_crls,
    )


async def with_requested_names_checked(
    pki: PkiEntry,
    backend: PkiBackend,
    csr: x509.CertificateSigningRequest,
    profile: CertificateProfile,
    enrollment: EnrollmentType,
) -> EnrollmentType:
    """``enrollment``, with a warning when the certificate lacks a name clients need to accept the device: the host
    certlm reaches it at, and the DNS names, IP addresses and ApplicationUri its CSR asks for. The host is checked
    whatever the CSR says, so that a PKI that drops it is noticed on every push, not only while the device's CSR still
    carries the name (a device that bases its CSR on its current certificate stops asking once it was dropped). A PKI
    entry with ``require_requested_names`` refuses such a certificate instead (422), and revokes it where the PKI
    can."""
    problem = missing_names_warning(enrollment.certificate, required_names(csr, profile.hosts))
    if problem is None:
        return enrollment
    if not pki.require_requested_names:
        return replace(enrollment, warnings=(*enrollment.warnings, problem))
    withdrawn = await _withdraw_unused(pki, backend, enrollment.certificate)
    raise CsrRejected(
        f"the PKI issued a certificate that {problem.removeprefix('the certificate ')}. PKI entry {pki.id} requires "
        f"the requested names (require_requested_names), so it was not "
        f"installed{withdrawn}. Change the PKI's certificate profile to keep subject alternative names, or PATCH "
        f"/pki/inventory/{pki.id} with require_requested_names false to accept it with a warning"
    )


def missing_names_warning(certificate: x509.Certificate, wanted: list[SubjectName]) -> str | None:
    """What an operator should know when ``certificate`` lacks names of ``wanted``; None when it has them all."""
    missing = missing_names(certificate, wanted)
    if not missing:
        return None
    names = ", ".join(general_name_text(name) for name in missing)
    return (
        f"the certificate does not name {names}, which the device is reached at or asked for: clients that connect "
        "to it by a missing name, or check its ApplicationUri, may refuse it"
    )


def host_names_warnings(host: str, certificate: x509.Certificate | None) -> list[str]:
    """For the certificate views: whether a device's certificate names the host certlm reaches it at, and carries an
    ApplicationUri at all (OPC UA clients refuse an application certificate without one)."""
    if certificate is None:
        return []
    warnings = []
    if warning := missing_names_warning(certificate, [host_general_name(host)]):
        warnings.append(warning)
    if not subject_alternative_names(certificate).get("uri"):
        warnings.append(
            "the certificate names no ApplicationUri (a URI subject alternative name): OPC UA clients refuse it"
        )
    return warnings


async def _withdraw_unused(pki: PkiEntry, backend: PkiBackend, certificate: x509.Certificate) -> str:
    """Revoke a certificate certlm will not install (reason superseded), where the PKI can; what happened, as the
    tail of a sentence."""
    serial = serial_hex(certificate)
    if not backend.offers("revoke"):
        return f"; the PKI cannot revoke it through certlm (serial {serial})"
    try:
        await backend.revoke(pki, certificate, x509.ReasonFlags.superseded)
        crl_cache().forget(pki.id)
    except APIError as error:
        log.warning("PKI entry %s: revoking unused certificate %s failed: %s", pki.id, serial, error.message)
        return f"; revoking it (serial {serial}) failed: {error.message}"
    return f" and was revoked (serial {serial})"


async def crls_of_chain(
    enrollment: Enrollment,
    ca_pool: tuple[x509.Certificate, ...],
    known: tuple[x509.CertificateRevocationList, ...],
) -> ChainCrls:
    """A CRL of each CA from the issued certificate's issuer up to the root. Devices that check revocation (as
    Part 12 servers with strict validation do) refuse a certificate while any CA on its path has no CRL in their
    trust list. Each certificate names where its issuer publishes the CRL that covers it (its distribution points),
    so the path is walked certificate by certificate; a CRL counts only when its CA's key signed it."""
    crls = list(known)
    missing = []
    path = [enrollment.certificate, *issuer_chain(enrollment.certificate, ca_pool)]
    for certificate, issuer in pairwise(path):
        if any(crl_signed_by(crl, [issuer]) for crl in crls):
            continue
        try:
            crls.append(await fetch_crl(cdp_urls(certificate), [issuer], current_host().services))
        except APIError as error:
            missing.append(f"no CRL of {issuer.subject.rfc4514_string()}: {error.message}")
    return ChainCrls(tuple(crls), tuple(missing))


async def choose_driver(entry: InventoryEntry, target: DeviceTarget) -> tuple[DeviceDriver, DeviceDescription]:
    """Ask the device who it is and store the most specific installed driver that declares support for it."""
    drivers = current_host().drivers
    description = await drivers.get(entry.service).describe(target)
    await adopt_description(entry, description)
    return drivers.get(entry.service), description


async def adopt_description(entry: InventoryEntry, description: DeviceDescription) -> None:
    """Store what the device said about itself and the driver it selects."""
    service = current_host().drivers.select_service(entry.protocol, description.identity) or entry.service
    entry.device_description = description_record(description)
    entry.service = service
    entry.firmware_version = description.identity.firmware or entry.firmware_version
    entry.device_name = description.identity.product or entry.device_name
    await entry.save(update_fields=["device_description", "service", "firmware_version", "device_name", "updated_at"])


def stored_identity(entry: InventoryEntry) -> DeviceIdentity | None:
    record = entry.device_description or {}
    identity = record.get("identity")
    return DeviceIdentity(**identity) if identity else None


async def push_to_address(
    protocol: str, server: str, port: int, settings: dict[str, Any], order: PushOrder
) -> dict[str, Any]:
    """``POST /gds/push`` and ``/gds/push/onboarding``: push to the device at ``server:port``, registering it when
    it is not in the inventory.

    A push that fails changes nothing but what the spec says it keeps: the credentials the device accepted, with the
    certificate it presented at first contact and the failure recorded as the entry's last push. The entry's
    ``settings`` (name, security policy and mode) and the PKI chosen for it are stored with a successful push only,
    and a device the push registered is removed again unless it accepted the connection."""
    entry = await device_entry_at(server, port)
    registered = entry is None
    if entry is None:
        entry = await create_entry(protocol, server, port, {})
    # Used by this push (``device_target``), stored by its success (``_record_success``).
    entry.update_from_dict(settings)
    try:
        return await push_certificate(entry, order)
    except APIError as error:
        if registered and not _device_accepted_connection(error):
            await entry.delete()
        raise


def _device_accepted_connection(error: APIError) -> bool:
    steps = error.details.get("result", {}).get("steps", [])
    return any(step.get("step") == "connect" and step.get("ok") for step in steps)


async def push_certificate(entry: InventoryEntry, order: PushOrder) -> dict[str, Any]:
    """Enroll a new certificate for ``entry``, store the outcome and record it as the entry's last push (or
    onboarding); the operation result.

    Raises ``PushError`` with the steps done (422 when the PKI refused the certificate request, the 4xx of a PKI
    entry that cannot be used as configured, 500 otherwise), or another ``APIError`` when the push could not start
    (no PKI, no pinned certificate for an automated push). Failures are recorded too.
    """
    # One push at a time per device, whichever instance runs it: two concurrent sessions would each make the device
    # discard the other's pending key pair. An operator's push waits for a running one, then answers 409.
    settings = current_host().settings
    async with device_lease(entry.id, wait_s=settings.device_operation_timeout_s, lease_s=settings.device_lease_s):
        started = api_now()
        try:
            result = await _push_locked(entry, order)
        except APIError as error:
            failed = {"url": entry_url(entry), "steps": [], **error.details.get("result", {})}
            await _record_push(entry, order, started, failed, error.message)
            raise
        if not order.automated:
            # The operator has dealt with the device: a certificate changed behind certlm's back is now certlm's
            # own again, and automated renewals start afresh.
            await DeviceSchedule.filter(entry_id=entry.id).update(
                certificate_changed_at=None, renewal_failures=0, renewal_retry_at=None
            )
        return await _record_push(entry, order, started, result)


async def _record_push(
    entry: InventoryEntry, order: PushOrder, started: str, result: dict[str, Any], error: str = ""
) -> dict[str, Any]:
    """The push as an operation result, filed as the entry's last push or onboarding with when it ran and what
    triggered it."""
    what = "onboarding" if order.onboarding else "certificate push"
    outcome = {
        "success": not error,
        "execution": f"{what} of {result['url']} {'failed' if error else 'completed'}",
        "error": error,
        "result": {**result, "at": started, "trigger": order.trigger},
    }
    record_operation(entry, order.operation, outcome)
    await entry.save(update_fields=["last_result", "updated_at"])
    return outcome


async def _push_locked(entry: InventoryEntry, order: PushOrder) -> dict[str, Any]:
    target = await device_target(entry)
    if order.username is not None:
        target.username, target.pkcs12, target.pkcs12_password = order.username, None, None
    if order.password is not None:
        target.password = order.password
    if order.automated and entry.pinned_certificate_der is None:
        raise APIError(
            f"{target.url} has no pinned device certificate, and automated operations never trust a device on first "
            "contact: an operator pushes to it or onboards it once (POST /gds/push/onboarding)",
            409,
        )
    # An operator's first contact, or re-onboarding after a device swap, accepts what the device presents.
    first_contact = not order.automated and (order.onboarding or entry.pinned_certificate_der is None)
    if first_contact:
        target.pinned_certificate = None
    pki = await enrollment_pki(entry)
    material = await pki_material(pki, entry)
    # A pinned device is identified by the push itself, whose connection checks the pin; at first contact the
    # push's own session describes the device and the host selects its driver from that (``PushRequest.identify``).
    request = PushRequest.asked(
        order,
        pinned_certificate=None if first_contact else entry.pinned_certificate_der,
        trusted_cas=material.ca_certificates,
        trust_on_first_use=first_contact,
        identify=partial(_select_driver, entry) if first_contact else None,
    )
    contact_note: str | None = None
    try:
        outcome = await current_host().drivers.get(entry.service).push(target, request, material)
    except PushFailed as failure:
        if isinstance(failure.__cause__, DeviceIdentityChanged):
            await mark_identity_changed(entry.id, failure.__cause__.message, datetime.now(UTC))
        if first_contact:
            contact_note = await pin_first_contact(entry, failure.presented_certificate)
        if any(s.step == "connect" and s.ok for s in failure.steps):
            # The device accepted these credentials; later renewals run unattended with them.
            await _store_tried_credentials(entry, order)
        log.info("push to %s failed: %s", target.url, failure.message)
        status = _push_failure_status(failure.__cause__)
        result: dict[str, Any] = {
            "url": target.url,
            "device_changed": failure.changed_device,
            "steps": _steps_view(failure.steps, order.debug),
        }
        if contact_note:
            result["first_contact"] = contact_note
        if warnings := _warnings(failure.steps):
            result["warnings"] = warnings
        raise PushError(failure.message, status, details={"result": result}) from failure
    if first_contact:
        contact_note = await pin_first_contact(entry, outcome.presented_certificate)
        # An operator's onboarding pins what the device presents on every channel: a changed identity is explained.
        await identity_repinned(entry.id)
    await _store_tried_credentials(entry, order)
    return await _record_success(entry, target, pki, outcome, order.debug, contact_note)


def _push_failure_status(cause: BaseException | None) -> int:
    """422 for a request the PKI refused; the 4xx of a PKI entry that cannot be used as configured (a missing
    credential names its field); 500 for anything that went wrong on the way."""
    if isinstance(cause, CsrRejected):
        return 422
    if isinstance(cause, APIError) and 400 <= cause.status < 500:
        return cause.status
    return 500


async def _select_driver(entry: InventoryEntry, description: DeviceDescription) -> DeviceDriver:
    """At an operator's first contact: store what the device said about itself in the push's session; the driver
    that description selects."""
    await adopt_description(entry, description)
    return current_host().drivers.get(entry.service)


async def pin_first_contact(entry: InventoryEntry, presented: x509.Certificate | None) -> str | None:
    """Pin the certificate a device presented at an operator's first contact (or re-onboarding); what was accepted,
    for the operator to compare with the device's display. None when the device was not reached."""
    if presented is None:
        return None
    der = to_der(presented)
    subject = presented.subject.rfc4514_string()
    note = f"first contact: device presented {subject}, SHA-1 {sha1_fingerprint(presented)}"
    previous = entry.pinned_certificate_der
    if previous is not None and previous != der:
        pinned_before = x509.load_der_x509_certificate(previous)
        note += f", replacing the pinned SHA-1 {sha1_fingerprint(pinned_before)}"
    entry.pinned_certificate_der = der
    update_fields = ["pinned_certificate_der", "updated_at"]
    if entry.certificate_der is None:
        entry.certificate_der = der
        update_fields.append("certificate_der")
    await entry.save(update_fields=update_fields)
    log.info("%s:%s %s; pinned on the operator's request", entry.server, entry.port, note)
    return f"{note}; pinned"


async def _store_tried_credentials(entry: InventoryEntry, order: PushOrder) -> None:
    if order.username is not None or order.password is not None:
        await save_credentials(entry, username=order.username, password=order.password)


async def _record_success(
    entry: InventoryEntry,
    target: DeviceTarget,
    pki: PkiEntry,
    outcome: PushOutcome,
    debug: bool,
    contact_note: str | None,
) -> dict[str, Any]:
    if outcome.description is not None:
        await adopt_description(entry, outcome.description)
    entry.certificate_der = to_der(outcome.certificate)
    # The device presents the certificate certlm just installed: from now on that is the one it must present.
    entry.pinned_certificate_der = entry.certificate_der
    # A certificate just issued is on no CRL; the monitor checks it from now on.
    store_revocation(entry, RevocationCheck(crl_status.NOT_REVOKED, "issued by this push"))
    entry.last_changed_certificate_date = datetime.now(UTC)
    entry.trustlist = trust_list_record(outcome.trust_list)
    result = {
        "url": target.url,
        "service": entry.service,
        "pki_endpoint": str(pki.id),
        "certificate": _certificate_summary(outcome.certificate),
        "trustlist": {key: len(items) for key, items in trust_list_record(outcome.trust_list).items()},
        "security_policy": outcome.security_policy,
        "security_mode": outcome.security_mode,
        "steps": _steps_view(outcome.steps, debug),
    }
    if contact_note:
        result["first_contact"] = contact_note
    if warnings := _warnings(outcome.steps):
        result["warnings"] = warnings
    await entry.save()
    return result


async def identify_registered(entry: InventoryEntry) -> None:
    """Identify a device as it is registered (``identification.identify_entry``), through the host's one queue of
    identifications: waits for it within a few connect time-outs, after which ``entry`` holds its driver and pinned
    certificate; a device not identified by then goes on being identified in the background."""
    await current_host().identification.identify(entry)


async def decommission(
    entry: InventoryEntry, describe: Callable[[InventoryEntry], Awaitable[Description]]
) -> Description:
    """Delete ``entry`` with its credentials and schedule (lease) rows, once no operation runs on its device; what
    ``describe`` makes of the entry as it was, just before, revocation included (``revoke_on_decommission``).

    A running operation (a push, a read, another instance's renewal) is waited for, at most a device operation's
    time-out (409 after that, the entry kept), rather than cut off: a push cut off between its steps could leave the
    device with a pending key pair or a half-written trust list. A caller waiting for the device meanwhile then finds
    the entry gone (404, ``EntryDeleted``)."""
    settings = current_host().settings
    wait_s = settings.device_operation_timeout_s
    async with device_lease(entry.id, wait_s=wait_s, queue_wait_s=wait_s, lease_s=settings.device_lease_s):
        # What the operation that ran stored: a certificate it installed is the one to revoke.
        if (current := await InventoryEntry.get_or_none(id=entry.id)) is None:
            raise EntryDeleted(entry.id)
        await revoke_on_decommission(current)
        described = await describe(current)
        await current.delete()
    return described


async def revoke_on_decommission(entry: InventoryEntry) -> bool:
    """Revoke the certificate of a device that leaves the plant (reason cessationOfOperation), when the entry's PKI
    issued it and can revoke. True when it was revoked. A PKI that fails to revoke raises, so the caller keeps the
    entry: deleting it would forget the only record of a certificate that stays valid."""
    if entry.pki_id is None or not entry.certificate_der or entry.cert_revoked:  # type: ignore[attr-defined]
        return False
    host = current_host()
    pki = await PkiEntry.get_or_none(id=entry.pki_id)  # type: ignore[attr-defined]
    if pki is None or not host.pki_backends.known(pki.pki_type):
        return False
    backend = host.pki_backends.get(pki.pki_type)
    if not backend.offers("revoke"):
        return False
    try:
        ca_certificates = tuple(await backend.ca_certificates(pki))
    except (NotFound, UnsupportedOperation):
        return False
    certificate = current_certificate_from(entry, ca_certificates)
    if certificate is None:
        return False
    try:
        await backend.revoke(pki, certificate, x509.ReasonFlags.cessation_of_operation)
    except APIError as error:
        raise APIError(
            f"the entry is kept: revoking its certificate (serial {serial_hex(certificate)}) at PKI entry {pki.id} "
            f"failed: {error.message}. Retry, or PATCH the entry's pki to null to delete it without revoking",
            error.status,
        ) from error
    crl_cache().forget(pki.id)
    store_revocation(
        entry, RevocationCheck(crl_status.REVOKED, "revoked on decommission", x509.ReasonFlags.cessation_of_operation)
    )
    log.info("revoked certificate %s of %s:%s on decommission", serial_hex(certificate), entry.server, entry.port)
    return True
