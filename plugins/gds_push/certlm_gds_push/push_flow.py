"""The GDS push flow: one enrollment in one session with the device, through OPC UA Part 12 push management.

connect → identify (an operator's first contact) → describe → create_signing_request (or generate_key) → enroll →
fetch_crls → write_trust_list → update_certificate → apply_changes → verify. The trust list goes first, as Part 12
(v1.05, 7.7) and the OPC Foundation's push client do: servers refuse to open it while a certificate update is
pending, and servers that check revocation refuse a certificate whose CA and CRL they do not hold yet. Every list
certlm writes keeps certlm trusted, so a failure after it was written still leaves a device certlm can reach, and
keeps what the request says it must go on trusting (``PushRequest.also_trusted``, in the lists of the same names). A
device that needs ApplyChanges keeps running on what it had until then: a failure before that point cancels the
pending changes, and its ``PushFailed`` says whether the device was changed (a device that applies a trust list or
certificate at once is). Verification is a second session: the device must present the issued certificate on it,
and its trust list must read back as written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from typing import ClassVar, Protocol, TypeVar, runtime_checkable

from asyncua import ua
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import pkcs12

from certlm import (
    CertlmKeyRequired,
    DeviceDescription,
    DeviceDriver,
    DeviceIdentityChanged,
    DeviceTarget,
    DeviceTimeouts,
    DriverSelection,
    Enrollment,
    PkiMaterial,
    PushFailed,
    PushOutcome,
    PushRequest,
    StepLog,
    StepNote,
    StepOutcome,
    TrustList,
    UnsupportedOperation,
    host_general_name,
    issued_by,
    to_der,
)
from certlm_gds_push.connection import (
    DeviceError,
    DeviceSession,
    Endpoint,
    ServerCheck,
    SessionSecurity,
    TimeLimit,
    certificate_name,
    explain,
    is_transient,
    server_endpoints,
    status_name,
    usable_endpoints,
)
from certlm_gds_push.identity import ClientIdentity
from certlm_gds_push.server_configuration import ServerConfiguration
from certlm_gds_push.trust_list import ISSUER_LISTS, TRUSTED_LISTS, TrustListFile, check_trust_list, to_data_type

log = logging.getLogger(__name__)

# Answers to CreateSigningRequest meaning "this device cannot make a CSR": certlm makes the key pair instead.
NO_CSR_STATUSES = frozenset({"BadNotSupported", "BadNotImplemented", "BadMethodInvalid"})
GENERATED_KEY_BITS = 2048
# Reconnecting to a device that reopens its endpoints after ApplyChanges: soon at first, since it is usually back
# within tens of milliseconds of its settle time, then less often, so that a device that stays away costs little.
VERIFY_RETRY_FIRST_S, VERIFY_RETRY_MAX_S = 0.05, 0.5
# The first attempt to reach it again gets this long, each next one twice as long up to a connect and an operation
# time-out: a connection the device accepted just as it closed its endpoints is never answered, and must not hold
# the step up for a whole connect time-out.
RECONNECT_ATTEMPT_FIRST_S = 1.0
# A session that drops in the middle of a push (a slow plant network, an overloaded gateway) is the normal case: the
# push is tried this many times in all, each in a fresh session, within the operation time-out from the first drop.
TRANSIENT_TRIES = 3
_T = TypeVar("_T")


def verify_retry_delays() -> Iterator[float]:
    """The pauses between attempts to reach a device that applied changes: doubling from the first to the most."""
    delay = VERIFY_RETRY_FIRST_S
    while True:
        yield delay
        delay = min(2 * delay, VERIFY_RETRY_MAX_S)


async def once_back(timeouts: DeviceTimeouts, attempt: Callable[[], Awaitable[_T]]) -> _T:
    """``attempt()`` again until it succeeds, for a device that reopens its endpoints after ApplyChanges, within the
    operation time-out: each attempt bounded (``RECONNECT_ATTEMPT_FIRST_S``, doubling up to both time-outs' sum),
    paused between as ``verify_retry_delays`` says. ``DeviceIdentityChanged`` ends it at once; else the last failure
    (an attempt that ran out of time as ``DeviceError`` BadTimeout) once the time is spent."""
    deadline = time.monotonic() + timeouts.operation_s
    delays = verify_retry_delays()
    bound = min(RECONNECT_ATTEMPT_FIRST_S, timeouts.connect_s)
    while True:
        try:
            # A time limit, not wait_for: on Python 3.11 wait_for runs the attempt as a task of its own.
            async with TimeLimit(bound):
                return await attempt()
        except DeviceIdentityChanged:
            raise
        except Exception as error:
            delay = next(delays)
            if time.monotonic() + delay > deadline:
                if isinstance(error, TimeoutError):
                    raise DeviceError(f"BadTimeout (no answer within {bound:g} s)", "BadTimeout") from error
                raise
        bound = min(2 * bound, timeouts.connect_s + timeouts.operation_s)
        await asyncio.sleep(delay)


# How a device reopening its endpoints answers a session begun meanwhile: on the endpoints it announced before, its
# security checks fail; as it closes them, the connection is reset.
REOPENING_STATUSES = frozenset({"BadSecurityChecksFailed", "BadCommunicationError"})


async def past_a_reopening(timeouts: DeviceTimeouts, open_session: Callable[[], Awaitable[_T]]) -> _T:
    """``open_session()`` for a try after the update was sent: the device may have taken it in and be reopening its
    endpoints with the new certificate (ApplyChanges closes every channel a moment later), and a session begun
    meanwhile fails as ``REOPENING_STATUSES`` say. Those failures are tried again, paused as the verification's,
    within the operation time-out, and so is a refused connection once one of them showed the device reopening (it
    refuses until it listens again); any other ends the try as before, a refusal first too (the device is down)."""
    deadline = time.monotonic() + timeouts.operation_s
    delays = verify_retry_delays()
    reopening = False
    while True:
        try:
            return await open_session()
        except Exception as error:
            delay = next(delays)
            status = status_name(error)
            reopening = reopening or status in REOPENING_STATUSES
            expected = status in REOPENING_STATUSES or (reopening and status == "BadNotConnected")
            if not expected or time.monotonic() + delay > deadline:
                raise
        await asyncio.sleep(delay)


@runtime_checkable
class PushDriver(Protocol):
    """What the flow asks of the driver it runs for: ``GdsPushDriver``, whose subclasses are the device- and
    firmware-specific drivers, implements it."""

    service: ClassVar[str]
    device_makes_csr: ClassVar[bool]
    apply_settle_s: ClassVar[float]

    @property
    def timeouts(self) -> DeviceTimeouts: ...

    async def client_identity(self) -> ClientIdentity: ...

    def session(
        self, target: DeviceTarget, security: SessionSecurity = ..., check_server: ServerCheck | None = None
    ) -> AbstractAsyncContextManager[DeviceSession]: ...

    async def read_build_info(self, session: DeviceSession) -> dict[str, str]: ...

    async def read_description(self, session: DeviceSession) -> DeviceDescription: ...

    def certificate_type(self, description: DeviceDescription) -> ua.NodeId: ...

    def private_key_format(self, description: DeviceDescription) -> str: ...

    def trust_list_limit(self, description: DeviceDescription) -> int: ...

    def csr_subject(self, subject: str | None) -> str: ...

    async def after_apply_changes(self, session: DeviceSession) -> None: ...


@dataclass
class Progress:
    """What a push got done across its sessions with the device: what a try after a dropped session need not do
    again, and whether the device may have taken the update in (``update_sent``), after which it is never sent
    again."""

    driver: PushDriver
    description: DeviceDescription | None = None
    enrollment: Enrollment | None = None
    private_key: rsa.RSAPrivateKey | None = None
    key_format: str = ""
    trust_list: TrustList | None = None
    trust_list_written: bool = False
    update_sent: bool = False
    changed_before_update: bool = False
    identified: bool = False
    handed_over: bool = False
    tries: int = 0
    retry_until: float | None = None


async def run_push(driver: PushDriver, target: DeviceTarget, request: PushRequest, pki: PkiMaterial) -> PushOutcome:
    """Enroll a new application certificate for the device's DefaultApplicationGroup; see the module docstring.

    With ``request.identify`` (an operator's first contact) the description read in this session selects the
    driver: the push goes on with it in the same session when it is a ``PushDriver``, else it is handed over.

    A session that drops once the push is under way (``is_transient``) is replaced by a fresh one, up to
    ``TRANSIENT_TRIES`` tries in all and within the operation time-out from the first drop, from the last step that
    is safe to repeat: a CSR (a new one replaces the pending one: a key the device may have dropped with the session is
    never used), a key certlm made and its certificate (kept), the trust list (whole or nothing), an update the
    device did not take in. Once UpdateCertificate or ApplyChanges was sent, the device is asked what it holds
    (``check_applied``) and the update is never sent again when it took it in."""
    run = StepLog(status_of=status_name, explain=explain)
    progress = Progress(driver)
    while True:
        progress.tries += 1
        try:
            return await push_once(run, progress, target, request, pki)
        except PushFailed as failure:
            if not try_again(run, progress, target, failure):
                raise


def try_again(run: StepLog, progress: Progress, target: DeviceTarget, failure: PushFailed) -> bool:
    """Whether a failed try is tried again in a fresh session; if so, says so in the log (INFO) and in the steps."""
    cause = failure.__cause__
    step = failure.steps[-1].step if failure.steps else "connect"
    connected = any(outcome.step == "connect" and outcome.ok for outcome in run.steps)
    if progress.handed_over or not connected or cause is None or not is_transient(cause):
        return False
    now = time.monotonic()
    if progress.retry_until is None:
        progress.retry_until = now + progress.driver.timeouts.operation_s
    if progress.tries >= TRANSIENT_TRIES or now >= progress.retry_until:
        return False
    resume = "checking what the device holds" if progress.update_sent else "from " + resume_step(progress)
    message = (
        f"{step} failed ({explain(cause)}): try {progress.tries + 1} of {TRANSIENT_TRIES} in a fresh session, {resume}"
    )
    log.info("push to %s: %s", target.url, message)
    run.steps.append(StepOutcome("retry", True, 0.0, status_name(cause), message, warning=True))
    return True


def resume_step(progress: Progress) -> str:
    """Where the next try starts over (after ``connect`` and ``describe``)."""
    if progress.enrollment is not None and progress.private_key is not None:
        return "write_trust_list, with the key certlm made and its certificate"
    return "create_signing_request" if progress.driver.device_makes_csr else "generate_key"


async def push_once(
    run: StepLog, progress: Progress, target: DeviceTarget, request: PushRequest, pki: PkiMaterial
) -> PushOutcome:
    """One try of the push, in one session (and the verification's): see ``run_push``."""
    driver = progress.driver
    issued = progress.enrollment.certificate if progress.enrollment is not None else None
    if run.presented_certificate is not None and request.trust_on_first_use:
        # A try after a drop meets the device the first try met (or presenting what this push installed).
        request = replace(request, trust_on_first_use=False, pinned_certificate=to_der(run.presented_certificate))
    async with AsyncExitStack() as connection:
        async with run.step("connect") as note:

            def open_session() -> Awaitable[DeviceSession]:
                check = known_device_check(request, issued)
                return connection.enter_async_context(driver.session(target, SessionSecurity.ENCRYPTED, check))

            if progress.update_sent:  # the device may be reopening its endpoints with what it took in
                session = await past_a_reopening(driver.timeouts, open_session)
            else:
                session = await open_session()
            if run.presented_certificate is None:
                run.presented_certificate = session.server_certificate
            note.message = (
                f"{session.endpoint.name}, the device presents {certificate_name(session.server_certificate)}"
            )
        description = progress.description
        if request.identify is not None and not progress.identified:
            selected, description = await identified(run, driver, session, request.identify)
            progress.identified = True
            if not isinstance(selected, PushDriver):
                await connection.aclose()
                progress.handed_over = True
                return await hand_over(run, selected, target, request, pki, description)
            if not describes_alike(selected, driver):
                description = None  # the selected driver reads the device its own way
            driver = progress.driver = selected
        configuration = ServerConfiguration(session)  # the well-known NodeIds, should describe fail
        try:
            async with run.step("describe") as note:
                if description is None:
                    description = await driver.read_description(session)
                progress.description = description
                configuration = await ServerConfiguration.locate(session)
                if not configuration.present:
                    raise DeviceError(
                        "the device has no ServerConfiguration object: it does not offer Part 12 push management",
                        "BadNotSupported",
                    )
                certificate_type = driver.certificate_type(description)
                device = description.identity
                note.message = f"{device.manufacturer} {device.product} {device.firmware}"

            applied = False
            if progress.update_sent:
                applied = await check_applied(run, progress, configuration, session)
            if not applied:
                await obtain_and_install(
                    run, progress, driver, session, configuration, certificate_type, description, target, request, pki
                )
        except PushFailed as failure:
            if not run.changed_device and not await configuration.cancel_changes():
                failure.changes_pending = asked_for_changes(failure.steps)
            raise

    enrollment, trust_list = progress.enrollment, progress.trust_list
    assert enrollment is not None and trust_list is not None
    async with run.step("verify") as note:
        await asyncio.sleep(driver.apply_settle_s)
        if progress.trust_list_written:
            async with session_presenting(driver, target, enrollment.certificate) as session:
                endpoint = session.endpoint
                trust_list_read_back = await confirm_trust_list(session, configuration, trust_list)
            note.message = f"the device presents the issued certificate on {endpoint.name}; {trust_list_read_back}"
        else:
            # Nothing but the certificate changed: its endpoints announcing it is the proof, without another secure
            # session (the next one, pinned to it, must meet it anyway).
            endpoint = await endpoint_presenting(driver, target, enrollment.certificate)
            note.message = (
                f"the device announces the issued certificate on {endpoint.name} (GetEndpoints); its trust list was "
                "held already and not written"
            )
    return run.outcome(
        enrollment,
        trust_list,
        description=description,
        security_policy=endpoint.policy_bit,
        security_mode=endpoint.mode_bit,
    )


async def obtain_and_install(
    run: StepLog,
    progress: Progress,
    driver: PushDriver,
    session: DeviceSession,
    configuration: ServerConfiguration,
    certificate_type: ua.NodeId,
    description: DeviceDescription,
    target: DeviceTarget,
    request: PushRequest,
    pki: PkiMaterial,
) -> None:
    """The steps from the certificate to ApplyChanges, what ``progress`` holds kept: a key certlm made and its
    certificate are used again on a later try, a CSR's never (the device may have dropped its key)."""
    # What certlm can refuse on its own it refuses before the device is asked for anything.
    identity = await driver.client_identity()
    if progress.enrollment is None or progress.private_key is None:
        # Planned here only to be measured against the device's limit: a device without one has nothing to refuse.
        if limit := driver.trust_list_limit(description):
            trust_list = planned_trust_list(request, pki, identity)
            try:
                check_trust_list(trust_list, limit, written_lists(trust_list))
            except DeviceError as error:
                run.fail("write_trust_list", error)
        progress.enrollment, progress.private_key, progress.key_format = await obtain_certificate(
            run, driver, session, configuration, certificate_type, description, target, request, pki
        )
        progress.trust_list = await trust_list_for_chain(
            run, driver, description, request, pki, identity, progress.enrollment
        )
    assert progress.trust_list is not None
    # At first contact certlm has written the device no list it could hold yet: reading it to compare would cost
    # three calls for nothing. A later try (after a drop) is no first contact: an earlier one may have written it.
    await install(run, progress, driver, session, configuration, certificate_type, unread=request.trust_on_first_use)


async def check_applied(
    run: StepLog, progress: Progress, configuration: ServerConfiguration, session: DeviceSession
) -> bool:
    """After a session dropped once UpdateCertificate or ApplyChanges was sent: whether the device took the issued
    certificate in (it presents it, or GetCertificates lists it), so the push goes on to verify it and sends no
    update again. Not taken in: the update went with the dropped session, and the push starts over from its CSR (or
    its certificate, for a key certlm made). A device that neither presents it nor has GetCertificates cannot tell,
    and the push fails rather than risk a second update."""
    assert progress.enrollment is not None
    issued = progress.enrollment.certificate
    async with run.step("check_applied") as note:
        if to_der(session.server_certificate) == to_der(issued):
            note.message = "the device presents the issued certificate: it took the update in before the drop"
            run.changed_device = True
            return True
        try:
            held = await application_certificates(configuration)
        except ua.UaStatusCodeError as error:
            raise DeviceError(
                f"the connection dropped after the update was sent; the device still presents "
                f"{certificate_name(session.server_certificate)} and cannot say what it holds (GetCertificates: "
                f"{status_name(error)}), so certlm does not send the update again. Read the device "
                "(GET /gds/monitor/...) or push again",
                "BadInvalidState",
            ) from error
        if to_der(issued) in held:
            note.message = "the device holds the issued certificate (GetCertificates): it took the update in"
            run.changed_device = True
            return True
        note.message = "the device does not hold the issued certificate (GetCertificates): the update was lost"
        progress.update_sent = False
        run.changed_device = progress.changed_before_update
        if progress.private_key is None:
            progress.enrollment = None  # the key of its CSR may be gone
        return False


async def application_certificates(configuration: ServerConfiguration) -> list[bytes]:
    """The certificates (DER) of the DefaultApplicationGroup as the device holds them now: GetCertificates (Part 12
    1.05), at its well-known NodeId; a device without it answers BadMethodInvalid or BadNodeIdUnknown."""
    method = ua.NodeId(ua.ObjectIds.ServerConfiguration_GetCertificates)
    _, certificates = await configuration.session.call(
        configuration.node_id, method, ua.Variant(configuration.group_id, ua.VariantType.NodeId)
    )
    return list(certificates or [])


# The steps after which a device holds changes until ApplyChanges or CancelChanges: a new key of CreateSigningRequest
# (regeneratePrivateKey), the trust list of CloseAndUpdate, the certificate of UpdateCertificate. The step that failed
# counts too: the device may have done its part before the answer was lost.
CHANGING_STEPS = frozenset({"create_signing_request", "write_trust_list", "update_certificate"})


def asked_for_changes(steps: list[StepOutcome]) -> bool:
    return any(step.step in CHANGING_STEPS for step in steps)


async def identified(
    run: StepLog, driver: PushDriver, session: DeviceSession, identify: DriverSelection
) -> tuple[DeviceDriver, DeviceDescription]:
    """The ``identify`` step: the device describes itself in the push's session and the host selects its driver."""
    async with run.step("identify") as note:
        description = await driver.read_description(session)
        selected = await identify(description)
        note.message = f"driver {selected.service}"
    return selected, description


def describes_alike(driver: PushDriver, other: PushDriver) -> bool:
    """Whether ``driver`` reads a device's description as ``other`` does, so that the description ``other`` read
    stands for it."""
    return all(
        getattr(type(driver), name) is getattr(type(other), name) for name in ("read_build_info", "read_description")
    )


async def hand_over(
    run: StepLog,
    selected: DeviceDriver,
    target: DeviceTarget,
    request: PushRequest,
    pki: PkiMaterial,
    description: DeviceDescription,
) -> PushOutcome:
    """The push of a driver that is no ``PushDriver``, after this flow identified the device: it must meet the device
    this session met (pinned), and its steps follow the ones so far."""
    presented = run.presented_certificate
    assert presented is not None  # the session was open
    handed = replace(request, identify=None, trust_on_first_use=False, pinned_certificate=to_der(presented))
    try:
        outcome = await selected.push(target, handed, pki)
    except PushFailed as failure:
        raise PushFailed(
            failure.message,
            run.steps + failure.steps,
            changed_device=failure.changed_device,
            presented_certificate=presented,
        ) from failure.__cause__
    return replace(
        outcome,
        steps=run.steps + outcome.steps,
        presented_certificate=presented,
        description=outcome.description or description,
    )


async def obtain_certificate(
    run: StepLog,
    driver: PushDriver,
    session: DeviceSession,
    configuration: ServerConfiguration,
    certificate_type: ua.NodeId,
    description: DeviceDescription,
    target: DeviceTarget,
    request: PushRequest,
    pki: PkiMaterial,
) -> tuple[Enrollment, rsa.RSAPrivateKey | None, str]:
    """The steps up to the issued certificate: a CSR from the device (or a key pair certlm makes, and the format the
    device takes it in), signed by the PKI; the key is None when the device holds it. When the PKI certifies no key
    the device made (``CertlmKeyRequired``) and its entry allows it, certlm makes the key and says why in the step
    ``generate_key``; without that permission the push fails with the PKI's message, which names the remedies."""
    csr: x509.CertificateSigningRequest | None = None
    if driver.device_makes_csr:
        async with run.step("create_signing_request") as note:
            subject = driver.csr_subject(request.subject)
            try:
                csr = x509.load_der_x509_csr(await configuration.create_signing_request(certificate_type, subject))
            except ua.UaStatusCodeError as error:
                if status_name(error) not in NO_CSR_STATUSES:
                    raise
                note.status = status_name(error)
                note.message = "the device cannot make a CSR: certlm makes the key pair"
            else:
                note.message = f"subject {subject!r}" if subject else "the device's current subject"
    private_key: rsa.RSAPrivateKey | None = None
    key_format = ""
    if csr is None:
        async with run.step("generate_key") as note:
            private_key, key_format, csr = await certlm_key(driver, description, request, session, target)
            note.message = f"RSA {GENERATED_KEY_BITS} key pair made in certlm, sent as {key_format}"

    async with run.step("enroll") as note:
        try:
            enrollment, private_key = await enroll(pki, csr, private_key, note)
        except CertlmKeyRequired as refusal:
            # The PKI certifies no key the device made: a key certlm makes, only where the PKI entry allows it.
            if private_key is not None or not refusal.certlm_keys_allowed:
                raise
            async with run.step("generate_key") as key_note:
                try:
                    private_key, key_format, csr = await certlm_key(driver, description, request, session, target)
                except DeviceError as error:
                    raise DeviceError(
                        f"{refusal.message}. This device takes no private key in a format certlm sends",
                        error.device_status,
                    ) from error
                key_note.message = (
                    f"RSA {GENERATED_KEY_BITS} key pair made in certlm, sent as {key_format}: {refusal.reason}"
                )
            enrollment = await pki.enroll(csr, private_key)
        via = f" via {enrollment.via}" if enrollment.via else ""
        note.message = f"issued {certificate_name(enrollment.certificate)}{via}{note.message}"
    for warning in enrollment.warnings:
        run.warn("check_names", warning)

    if not issuer_known(enrollment.certificate, (*enrollment.chain, *pki.ca_certificates)):
        run.fail(
            "enroll",
            DeviceError(
                f"the PKI issued {certificate_name(enrollment.certificate)} but sent no certificate of its issuer "
                f"{enrollment.certificate.issuer.rfc4514_string()}, and none is known: the device could not "
                "verify it",
                "BadCertificateChainIncomplete",
            ),
        )
    return enrollment, private_key, key_format


async def trust_list_for_chain(
    run: StepLog,
    driver: PushDriver,
    description: DeviceDescription,
    request: PushRequest,
    pki: PkiMaterial,
    identity: ClientIdentity,
    enrollment: Enrollment,
) -> TrustList:
    """The trust list to write, now that the chain is known (a PKI may hand it out only with a certificate, as CMP
    caPubs): it gets the chain and the CRL of every CA on it, since a device that checks revocation needs them all."""
    crls = pki.crls
    if pki.chain_crls is not None:
        async with run.step("fetch_crls") as note:
            chain_crls = await pki.chain_crls(enrollment)
            crls = chain_crls.crls
            note.message = f"{len(crls)} CRLs for the chain" + "".join(
                f"; {missing} (devices that check revocation will refuse the certificate)"
                for missing in chain_crls.missing
            )
    trust_list = planned_trust_list(request, pki, identity, enrollment.chain, crls)
    try:
        check_trust_list(trust_list, driver.trust_list_limit(description), written_lists(trust_list))
    except DeviceError as error:
        run.fail("write_trust_list", error)
    return trust_list


async def install(
    run: StepLog,
    progress: Progress,
    driver: PushDriver,
    session: DeviceSession,
    configuration: ServerConfiguration,
    certificate_type: ua.NodeId,
    *,
    unread: bool = False,
) -> None:
    """Write the trust list unless the device holds it already, then the certificate, then ApplyChanges when either
    asked for it; ``progress`` gets the trust list as written (or held), and whether it was written. ``unread``: the
    trusted lists are written without reading first what the device holds (the issuer lists, which keep what the
    device has there, are read whatever it says)."""
    enrollment, trust_list = progress.enrollment, progress.trust_list
    assert enrollment is not None and trust_list is not None
    async with run.step("write_trust_list") as note:
        trust_file = await configuration.trust_list_file()  # found with the ServerConfiguration
        lists = written_lists(trust_list)
        held = None if unread and not lists & ISSUER_LISTS else await lists_held(trust_file, lists)
        if lists & ISSUER_LISTS:
            trust_list = keeping_device_issuers(held, trust_list)
        written = False
        issuers = (
            f", {len(trust_list.issuer_certificates)} issuer certificates and {len(trust_list.issuer_crls)} CRLs"
            if lists & ISSUER_LISTS
            else ""
        )
        counts = f"{len(trust_list.trusted_certificates)} trusted certificates, {len(trust_list.trusted_crls)} CRLs"
        if isinstance(held, TrustList) and _as_stored(held) == _as_stored(trust_list):
            # A renewal, or a campaign's reissue after its trust phase: the device holds the list already, and
            # writing it again would only make it one more thing to read back.
            apply_required = False
            note.message = f"{counts}{issuers}, held by the device already: not written"
        else:
            apply_required = await trust_file.write(to_data_type(trust_list, lists))
            written = True
            # A device that applies CloseAndUpdate at once is changed from here on (and still trusts certlm).
            run.changed_device |= not apply_required
            note.message = f"{counts}{issuers}, {_pending_or_applied(apply_required)}"
        # A try after a drop that finds the list held (applied at once by an earlier try) still reads it back.
        progress.trust_list, progress.trust_list_written = trust_list, written or progress.trust_list_written

    async with run.step("update_certificate") as note:
        key_blob = (
            private_key_blob(progress.private_key, progress.key_format, enrollment) if progress.private_key else b""
        )
        progress.changed_before_update, progress.update_sent = run.changed_device, True
        certificate_pending = await configuration.update_certificate(
            certificate_type, enrollment, progress.key_format, key_blob
        )
        run.changed_device |= not certificate_pending
        apply_required |= certificate_pending
        note.message = _pending_or_applied(certificate_pending)

    async with run.step("apply_changes") as note:
        if apply_required:
            await apply_changes(run, configuration)
            await driver.after_apply_changes(session)
        else:
            note.message = "not needed: the device applied the changes at once"


def written_lists(trust_list: TrustList) -> int:
    """The lists a push writes (``TrustList.MASK_BITS``): the trusted ones, which certlm owns, and the issuer ones
    only when the request must keep issuers trusted (``also_trusted``); else they stay as the device has them."""
    has_issuers = trust_list.issuer_certificates or trust_list.issuer_crls
    return TRUSTED_LISTS | (ISSUER_LISTS if has_issuers else 0)


async def lists_held(trust_file: TrustListFile, lists: int) -> TrustList | ua.UaStatusCodeError:
    """The ``lists`` the device holds, to compare with what the push would write; the device's refusal instead when
    it does not let them be read (a push that writes only the trusted lists then writes them unread)."""
    try:
        return await trust_file.read_lists(lists)
    except ua.UaStatusCodeError as error:
        return error


def keeping_device_issuers(held: TrustList | ua.UaStatusCodeError, trust_list: TrustList) -> TrustList:
    """``trust_list`` with the issuer certificates and CRLs the device holds (``held``) ahead of its own: writing the
    issuer lists replaces them, and what the device has there is not certlm's to drop."""
    if isinstance(held, ua.UaStatusCodeError):
        raise DeviceError(
            "certlm must read the device's issuer certificates and CRLs to add the ones it must keep trusted beside "
            f"them, and the device refuses that: {explain(held)}",
            status_name(held),
        ) from held
    return replace(
        trust_list,
        issuer_certificates=_unique([*held.issuer_certificates, *trust_list.issuer_certificates]),
        issuer_crls=_unique([*held.issuer_crls, *trust_list.issuer_crls]),
    )


async def apply_changes(run: StepLog, configuration: ServerConfiguration) -> None:
    # Unless the device answers with a refusal it may have switched: it counts as changed from the call on.
    run.changed_device = True
    try:
        await configuration.apply_changes()
    except ua.UaStatusCodeError:
        run.changed_device = False
        raise


def _pending_or_applied(pending: bool) -> str:
    return "pending until ApplyChanges" if pending else "applied by the device at once"


def known_device_check(request: PushRequest, issued: x509.Certificate | None = None) -> ServerCheck | None:
    """Unless the request trusts the device on first contact, it must present the pinned certificate or one issued
    by the PKI's CAs (or ``issued``, the certificate this push installed before its session dropped); a device that
    presents anything else gets nothing, not even the user's password."""
    if request.trust_on_first_use:
        return None

    def check(certificate: x509.Certificate) -> None:
        if request.pinned_certificate is not None and to_der(certificate) == request.pinned_certificate:
            return
        if issued is not None and to_der(certificate) == to_der(issued):
            return
        if any(issued_by(certificate, ca) for ca in request.trusted_cas):
            return
        expected = []
        if request.pinned_certificate is not None:
            expected.append(certificate_name(x509.load_der_x509_certificate(request.pinned_certificate)))
        if request.trusted_cas:
            cas = "; ".join(certificate_name(ca) for ca in request.trusted_cas)
            expected.append(f"a certificate issued by the PKI's CA {cas}")
        raise DeviceIdentityChanged(
            "application certificate",
            " or ".join(expected) or "none",
            certificate_name(certificate),
            "If the device was replaced or reset, re-onboard it (POST /gds/push/onboarding) to accept the certificate "
            "it presents now",
            "BadCertificateUntrusted",
        )

    return check


async def certlm_key(
    driver: PushDriver,
    description: DeviceDescription,
    request: PushRequest,
    session: DeviceSession,
    target: DeviceTarget,
) -> tuple[rsa.RSAPrivateKey, str, x509.CertificateSigningRequest]:
    """A key pair certlm makes for the device, the format the device takes it in, and its CSR."""
    key_format = driver.private_key_format(description)
    private_key = await asyncio.to_thread(rsa.generate_private_key, public_exponent=65537, key_size=GENERATED_KEY_BITS)
    return private_key, key_format, certlm_csr(private_key, request.subject, session, target)


async def enroll(
    pki: PkiMaterial, csr: x509.CertificateSigningRequest, private_key: rsa.RSAPrivateKey | None, note: StepNote
) -> tuple[Enrollment, rsa.RSAPrivateKey | None]:
    """The issued certificate, and the key the device gets when certlm (not the device) holds it. For a device that
    cannot make keys, a PKI that makes them (EST serverkeygen) is asked to; the key made here is the fallback."""
    if private_key is None or pki.enroll_server_key is None:
        return await pki.enroll(csr, private_key), private_key
    try:
        keyed = await pki.enroll_server_key(csr)
    except UnsupportedOperation as error:
        note.message = f"; the PKI did not make the key ({error.message}), certlm's is used"
        return await pki.enroll(csr, private_key), private_key
    if not isinstance(keyed.private_key, rsa.RSAPrivateKey):
        raise DeviceError(
            f"the PKI made a {type(keyed.private_key).__name__} key; the device's certificate type needs RSA",
            "BadCertificateInvalid",
        )
    note.message = f"; key pair made by the PKI ({keyed.private_key.key_size}-bit RSA)"
    return keyed, keyed.private_key


def issuer_known(certificate: x509.Certificate, candidates: Iterable[x509.Certificate]) -> bool:
    """Whether ``certificate`` is self-signed or one of ``candidates`` issued it (signature checked)."""
    return any(issued_by(certificate, issuer) for issuer in (certificate, *candidates))


def planned_trust_list(
    request: PushRequest,
    pki: PkiMaterial,
    identity: ClientIdentity,
    chain: tuple[x509.Certificate, ...] = (),
    crls: tuple[x509.CertificateRevocationList, ...] | None = None,
) -> TrustList:
    """The lists certlm writes: the PKI's CA chain and CRLs, plus certlm's client certificate or its issuers as the
    request asks, plus what the request must keep trusted beside them (``also_trusted``, each in the list of the
    same name). The device must keep accepting certlm after ApplyChanges, or no later renewal could reach it: when
    neither the request nor the PKI's chain makes it trust certlm, certlm's own certificate is added (the narrowest
    trust that does; ``issuer`` widens it to certlm's CA so renewals of certlm's certificate keep working).
    """
    trusted = [to_der(ca) for ca in (*pki.ca_certificates, *chain)]
    if request.add_issuer or (request.onboarding and not identity.self_signed):
        trusted += [to_der(issuer) for issuer in identity.chain]
    # also_trusted does not count here: a campaign removes it once no peer needs it, and certlm must stay in.
    if request.add_client_certificate or not identity.trusted_by(trusted):
        trusted.append(identity.certificate_der)
    crl_ders = [crl.public_bytes(serialization.Encoding.DER) for crl in (pki.crls if crls is None else crls)]
    also = request.also_trusted
    return TrustList(
        trusted_certificates=_unique([*trusted, *also.trusted_certificates]),
        trusted_crls=_unique([*crl_ders, *also.trusted_crls]),
        issuer_certificates=_unique(also.issuer_certificates),
        issuer_crls=_unique(also.issuer_crls),
    )


def _unique(items: Iterable[bytes]) -> list[bytes]:
    return list(dict.fromkeys(items))


def certlm_csr(
    key: rsa.RSAPrivateKey, subject: str | None, session: DeviceSession, target: DeviceTarget
) -> x509.CertificateSigningRequest:
    """A CSR for a key certlm made: the requested subject (else the device's current one), the device's
    ApplicationUri as URI SAN and the address certlm reaches it at."""
    try:
        name = x509.Name.from_rfc4514_string(subject) if subject else session.server_certificate.subject
    except ValueError as error:
        raise DeviceError(f"subject {subject!r} is not an RFC 4514 distinguished name", "BadInvalidArgument") from error
    names = [
        x509.UniformResourceIdentifier(session.endpoint.description.Server.ApplicationUri),
        host_general_name(target.server),
    ]
    return (
        x509.CertificateSigningRequestBuilder()
        .subject_name(name)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )


def private_key_blob(key: rsa.RSAPrivateKey, key_format: str, enrollment: Enrollment) -> bytes:
    """A key certlm made, as UpdateCertificate's privateKey: PEM (PKCS#8) or PFX (PKCS#12 without a password, since
    UpdateCertificate has none to pass)."""
    if key_format == "PEM":
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    return pkcs12.serialize_key_and_certificates(
        None, key, enrollment.certificate, list(enrollment.chain) or None, serialization.NoEncryption()
    )


@asynccontextmanager
async def session_presenting(
    driver: PushDriver, target: DeviceTarget, issued: x509.Certificate
) -> AsyncIterator[DeviceSession]:
    """A SignAndEncrypt session on which the device presents ``issued``: reconnect with fresh clients until it does,
    within the operation time-out (a device restarts its endpoints some time after ApplyChanges)."""
    issued_der = to_der(issued)

    def check(certificate: x509.Certificate) -> None:
        if to_der(certificate) != issued_der:
            raise DeviceError(
                f"the device still presents {certificate_name(certificate)}, not the issued certificate",
                "BadCertificateInvalid",
            )

    async with AsyncExitStack() as stack:
        yield await once_back(
            driver.timeouts,
            lambda: stack.enter_async_context(driver.session(target, SessionSecurity.ENCRYPTED, check)),
        )


async def endpoint_presenting(driver: PushDriver, target: DeviceTarget, issued: x509.Certificate) -> Endpoint:
    """The strongest SignAndEncrypt endpoint once the device announces ``issued`` on it: GetEndpoints again until
    it does, within the operation time-out (a device restarts its endpoints some time after ApplyChanges)."""
    issued_der = to_der(issued)

    async def presenting() -> Endpoint:
        endpoint = usable_endpoints(
            await server_endpoints(target.url, driver.timeouts), target, SessionSecurity.ENCRYPTED
        )[0]
        presented = endpoint.certificate
        if presented is None:
            raise DeviceError("the device announces no certificate in its endpoints", "BadCertificateInvalid")
        if to_der(presented) != issued_der:
            raise DeviceError(
                f"the device still presents {certificate_name(presented)}, not the issued certificate",
                "BadCertificateInvalid",
            )
        return endpoint

    return await once_back(driver.timeouts, presenting)


async def confirm_trust_list(session: DeviceSession, written_in: ServerConfiguration, written: TrustList) -> str:
    """Read the written lists back in ``session`` and raise when they are not what was written (stock node-opcua, for
    one, answers CloseAndUpdate with Good and keeps its old list). A device that does not let them be read is only
    noted. The TrustList's nodes are those the push's session found (``written_in``): the device's address space is
    the same after it applied the changes, so they are not looked up again."""
    lists = written_lists(written)
    try:
        trust_file = replace(await written_in.trust_list_file(), session=session)
        on_device = await trust_file.read_lists(lists)
    except Exception as error:
        return f"its trust list could not be read back ({explain(error)})"
    # Devices store a trust list as they like (node-opcua as files named by thumbprint): the order may change.
    if _as_stored(on_device) != _as_stored(written):
        raise DeviceError(
            "the device presents the issued certificate, but its trust list is not the one written "
            f"({_sizes(on_device)} instead of {_sizes(written)}): it did not apply CloseAndUpdate",
            "BadInvalidState",
        )
    return "its trust list reads back as written"


def _as_stored(trust_list: TrustList) -> list[list[bytes]]:
    return [sorted(part) for part in vars(trust_list).values()]


def _sizes(trust_list: TrustList) -> str:
    return ", ".join(
        f"{len(part)} {name.replace('_', ' ').replace('crls', 'CRLs')}" for name, part in vars(trust_list).items()
    )
