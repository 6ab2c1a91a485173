"""The REST flows that change a device, each over one verified connection to its management API: a push (one
enrollment), and a trust list written on its own (``run_trust_list_write``, what a fleet campaign asks), which stages,
applies, verifies and rolls back as the push does.

connect (TLS against the pin, or pinned at an operator's first contact; log in; read the certificate in use) →
identify (first contact) → describe → create_signing_request (or generate_key) → enroll → fetch_crls →
upload_trust_list → upload_certificate → apply → verify. Uploads are staged: a failure before apply discards them and
the device runs on what it had. The trusted list written is the PKI's CAs and CRLs and what the request keeps trusted
(``PushRequest.also_trusted``), plus what the device holds that certlm did not write (``merged_trust_list``).
Verification reads the certificate and trust list back through the API and, when the entry names its OPC UA endpoint,
waits up to ``rest_verify_wait_s`` for that endpoint to present the issued certificate. A failed apply or
verification is rolled back (``rollback``): the device goes back to its previous files, and the push reports the
device unchanged once it presents its previous certificate again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from contextlib import AsyncExitStack
from dataclasses import replace

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from certlm import (
    DeviceDescription,
    DeviceFailure,
    DeviceTarget,
    Enrollment,
    PkiMaterial,
    PushFailed,
    PushOutcome,
    PushRequest,
    StepLog,
    TrustList,
    UnsupportedOperation,
    host_general_name,
    is_self_signed,
    issued_by,
    issuer_chain,
    to_der,
)
from certlm_rest.connection import BAD_ANSWER, ManagementApi, describe_certificate
from certlm_rest.interface import RestDriver
from certlm_rest.models import digests
from certlm_rest.opcua_endpoint import CERTIFICATE_MISMATCH, await_endpoint_presenting

# A trust list handed to ``write_trust_list`` holding something that is not a DER certificate or CRL.
INVALID_TRUST_LIST = "InvalidTrustList"


async def run_push(
    driver: RestDriver, target: DeviceTarget, request: PushRequest, pki: PkiMaterial
) -> PushOutcome:
    """Enroll a new application certificate through the management API; see the module docstring. At an
    operator's first contact (``request.identify``) the device's description selects the driver: the push goes on
    in this connection when that driver speaks the API the device answered, else it is handed over."""
    run = StepLog()
    credentials = await driver.credentials(target)
    stored = await driver.stored(target)
    opcua_url = stored.opcua_url if stored is not None else None
    async with AsyncExitStack() as connection:
        description: DeviceDescription | None = None
        async with run.step("connect") as note:
            api = await connection.enter_async_context(
                driver.connection(target, first_contact=request.trust_on_first_use)
            )
            speaking = driver
            if request.identify is not None:
                speaking, description = await driver.recognise(api, credentials)
            else:
                await driver.login(api, credentials)
            previous = await speaking.read_installed_certificate(api)
            run.presented_certificate = previous
            tls = await driver.pin_tls(target, api) if request.trust_on_first_use else "TLS certificate as pinned"
            note.message = f"{tls}; the OPC UA server uses {describe_certificate(previous)}"
        if request.identify is not None:
            assert description is not None
            async with run.step("identify") as note:
                selected = await request.identify(description)
                note.message = f"driver {selected.service}"
            if type(selected) is not type(speaking):
                await connection.aclose()
                return await hand_over(run, selected, target, request, pki, description)
            driver = selected  # type: ignore[assignment]
        enrollment, written, trust_list = await stage(run, driver, api, target, request, pki, description, previous)
        try:
            async with run.step("apply") as note:
                run.changed_device = True  # whatever the answer, the device may have switched
                await driver.apply(api)
                note.message = "the device took the staged files into use and keeps its previous ones"
            async with run.step("verify") as note:
                note.message, on_device = await verify(driver, api, enrollment.certificate, trust_list, opcua_url)
        except PushFailed as failure:
            raise await rolled_back(run, driver, api, failure, previous, opcua_url) from failure.__cause__
    await driver.remember_written_trust_list(target, written)
    return run.outcome(enrollment, on_device, description=description)


async def run_trust_list_write(driver: RestDriver, target: DeviceTarget, trust_list: TrustList) -> TrustList:
    """Make ``trust_list`` the device's trust list, over one connection made as for the entry's automated operations
    (the pinned TLS certificate, the stored credentials): stage its trusted lists, apply, verify that the device still
    uses its certificate and now the list uploaded, and roll back when it does not, as the push does. The trust list
    the device holds afterwards, read back.

    Nothing is sent when ``trust_list`` holds what is not a DER certificate (or CRL), nothing written when the device
    holds the list already, and a list whose issuer lists differ from the device's is ``UnsupportedOperation``: the
    generic API writes only the trusted lists. No entry of the list is what lets certlm in (it logs in with its
    credentials over the pinned TLS connection, and checks the OPC UA endpoint without a session), so no list is
    refused for locking certlm out. A failure before apply discards what was staged; after apply the device goes back
    to its previous files, and the failure says whether it did. What the list removes of what certlm's pushes wrote is
    forgotten (``still_written``)."""
    checked_der(trust_list)
    stored = await driver.stored(target)
    opcua_url = stored.opcua_url if stored is not None else None
    async with driver.logged_in(target, "writing the trust list") as api:
        description = await driver.read_description(api)
        in_use = await driver.read_installed_certificate(api)
        held = await driver.read_installed_trust_list(api)
        if not (issuer_lists_hold(held, trust_list) and issuer_lists_hold(trust_list, held)):
            raise UnsupportedOperation(
                f"service {driver.service} does not support writing the issuer lists: a device keeps its own, and "
                "the list to write differs from them; nothing was written"
            )
        if _as_stored(held) == _as_stored(trust_list):
            return held
        check_trust_list_size(trust_list, description)
        written_before = await driver.written_trust_list(target)
        try:
            await driver.upload_trust_list(api, trust_list)
        except DeviceFailure:
            with contextlib.suppress(DeviceFailure):
                await driver.discard(api)
            raise
        try:
            await driver.apply(api)
            _, on_device = await verify(driver, api, in_use, trust_list, opcua_url, named="its certificate")
        except DeviceFailure as failure:
            try:
                await restore_previous(driver, api, in_use, opcua_url)
            except DeviceFailure as rollback:
                outcome = f"; rollback failed: {rollback.message}: the device may be left without a working trust list"
            else:
                outcome = "; rolled back: the device runs on its previous trust list"
            raise DeviceFailure(failure.message + outcome, failure.device_status) from failure
    await driver.remember_written_trust_list(target, still_written(trust_list, written_before))
    return on_device


async def stage(
    run: StepLog,
    driver: RestDriver,
    api: ManagementApi,
    target: DeviceTarget,
    request: PushRequest,
    pki: PkiMaterial,
    description: DeviceDescription | None,
    previous: x509.Certificate,
) -> tuple[Enrollment, TrustList, TrustList]:
    """Every step before apply: the issued certificate and the trust list, both staged on the device. The
    enrollment, what certlm wrote of the trusted list and the whole list staged (with what the device kept). A failure
    discards what was staged (as far as the device can still be reached)."""
    try:
        async with run.step("describe") as note:
            if description is None:
                description = await driver.read_description(api)
            identity = description.identity
            note.message = f"{identity.manufacturer} {identity.product} {identity.firmware}"
        csr: x509.CertificateSigningRequest | None = None
        if description.capabilities.get("key_generation", True) is not False:
            async with run.step("create_signing_request") as note:
                csr = await driver.create_csr(api, request.subject)
                note.message = "the device made a key pair" if csr else "the device cannot make a key pair"
        private_key: rsa.RSAPrivateKey | None = None
        if csr is None:
            async with run.step("generate_key") as note:
                private_key = await asyncio.to_thread(rsa.generate_private_key, 65537, driver.key_bits)
                csr = certlm_csr(private_key, request.subject, previous, target)
                note.message = f"RSA {driver.key_bits} key pair made in certlm, sent with the certificate"
        async with run.step("enroll") as note:
            enrollment = await pki.enroll(csr, private_key)
            note.message = f"issued {describe_certificate(enrollment.certificate)}"
        for warning in enrollment.warnings:
            run.warn("check_names", warning)
        if not any(issued_by(enrollment.certificate, ca) for ca in (enrollment.certificate, *enrollment.chain,
                                                                     *pki.ca_certificates)):  # fmt: skip
            run.fail("enroll", DeviceFailure(
                f"the PKI issued {describe_certificate(enrollment.certificate)} but no certificate of its issuer is "
                "known: the device could not verify it", BAD_ANSWER))  # fmt: skip
        crls = pki.crls
        if pki.chain_crls is not None:
            async with run.step("fetch_crls") as note:
                chain_crls = await pki.chain_crls(enrollment)
                crls = chain_crls.crls
                note.message = f"{len(crls)} CRLs for the chain" + "".join(f"; {m}" for m in chain_crls.missing)
        written = planned_trust_list(pki, enrollment, crls, request.also_trusted)
        async with run.step("upload_trust_list") as note:
            on_device = await driver.read_installed_trust_list(api)
            if not issuer_lists_hold(on_device, request.also_trusted):
                raise DeviceFailure(
                    "the request keeps issuer certificates or CRLs trusted that the device's issuer lists lack, and "
                    f"{driver.service} writes only the trusted lists: nothing was staged",
                    "NotSupported",
                )
            trust_list, kept = merged_trust_list(written, on_device, await driver.written_trust_list(target))
            check_trust_list_size(trust_list, description)
            await driver.upload_trust_list(api, trust_list)
            note.message = (
                f"{len(trust_list.trusted_certificates)} trusted certificates, {len(trust_list.trusted_crls)} CRLs "
                f"({kept} of them the device's own, kept), staged"
            )
        async with run.step("upload_certificate") as note:
            chain = device_chain(enrollment, pki)
            await driver.upload_certificate(api, enrollment.certificate, chain, private_key)
            note.message = f"with {len(chain)} chain certificates (issuer first, no root)"
            note.message += (", and its key" if private_key else "") + ", staged"
    except PushFailed:
        with contextlib.suppress(DeviceFailure):
            await driver.discard(api)
        raise
    return enrollment, written, trust_list


async def verify(
    driver: RestDriver,
    api: ManagementApi,
    expected: x509.Certificate,
    trust_list: TrustList,
    opcua_url: str | None,
    named: str = "the issued certificate",
) -> tuple[str, TrustList]:
    """That the device uses ``expected`` (``named`` so in messages) and the trusted lists uploaded: what was checked,
    in words, and the trust list the device holds, as read back (all four lists)."""
    await asyncio.sleep(driver.apply_settle_s)
    installed = await driver.read_installed_certificate(api)
    if to_der(installed) != to_der(expected):
        raise DeviceFailure(
            f"the device reports {describe_certificate(installed)} in use, not {named}", CERTIFICATE_MISMATCH
        )
    on_device = await driver.read_installed_trust_list(api)
    if _as_stored(on_device) != _as_stored(trust_list):
        raise DeviceFailure(
            "the device's trusted certificates and CRLs are not the ones uploaded "
            f"({len(on_device.trusted_certificates)} certificates and {len(on_device.trusted_crls)} CRLs instead of "
            f"{len(trust_list.trusted_certificates)} and {len(trust_list.trusted_crls)})",
            CERTIFICATE_MISMATCH,
        )
    checked = f"the API reports {named} and the trust list as uploaded"
    if opcua_url is None:
        return checked + "; the entry names no OPC UA endpoint to check", on_device
    waited = await await_endpoint_presenting(opcua_url, expected, driver.timeouts, driver.verify_wait_s)
    return f"{checked}; {opcua_url} presents {named} (after {waited:.1f} s)", on_device


async def restore_previous(
    driver: RestDriver, api: ManagementApi, previous: x509.Certificate, opcua_url: str | None
) -> None:
    """Ask the device to go back to the files in use before the last apply, and check that it presents
    ``previous`` again (on the API, and on the OPC UA endpoint when the entry names one)."""
    await driver.rollback(api)
    installed = await driver.read_installed_certificate(api)
    if to_der(installed) != to_der(previous):
        raise DeviceFailure(
            f"after rollback the device reports {describe_certificate(installed)} in use, not its previous "
            f"{describe_certificate(previous)}",
            CERTIFICATE_MISMATCH,
        )
    if opcua_url is not None:
        await await_endpoint_presenting(opcua_url, previous, driver.timeouts, driver.verify_wait_s)


async def rolled_back(
    run: StepLog,
    driver: RestDriver,
    api: ManagementApi,
    failure: PushFailed,
    previous: x509.Certificate,
    opcua_url: str | None,
) -> PushFailed:
    """After a failed apply or verification: ask the device to go back to its previous files and check that it
    presents its previous certificate again. The ``PushFailed`` to raise, the rollback among its steps."""
    try:
        async with run.step("rollback") as note:
            await restore_previous(driver, api, previous, opcua_url)
            run.changed_device = False
            note.message = f"the device uses its previous certificate {describe_certificate(previous)} again"
        outcome = "; rolled back: the device runs on its previous certificate"
    except PushFailed as rollback:
        outcome = f"; {rollback.message}: the device may be left without a working certificate"
    return PushFailed(
        failure.message + outcome,
        run.steps,
        changed_device=run.changed_device,
        presented_certificate=run.presented_certificate,
    )


async def hand_over(
    run: StepLog,
    selected: object,
    target: DeviceTarget,
    request: PushRequest,
    pki: PkiMaterial,
    description: DeviceDescription,
) -> PushOutcome:
    """The push of the driver the host selected when it speaks another API than the one this connection used: it
    meets the device pinned now, and its steps follow the ones so far."""
    presented = run.presented_certificate
    assert presented is not None
    handed = replace(request, identify=None, trust_on_first_use=False, pinned_certificate=to_der(presented))
    try:
        outcome = await selected.push(target, handed, pki)  # type: ignore[attr-defined]
    except PushFailed as failure:
        raise PushFailed(
            failure.message, run.steps + failure.steps, changed_device=failure.changed_device,
            presented_certificate=presented,
        ) from failure.__cause__  # fmt: skip
    return replace(outcome, steps=run.steps + outcome.steps, presented_certificate=presented,
                   description=outcome.description or description)  # fmt: skip


def planned_trust_list(
    pki: PkiMaterial,
    enrollment: Enrollment,
    crls: tuple[x509.CertificateRevocationList, ...],
    also_trusted: TrustList,
) -> TrustList:
    """The trusted lists certlm writes: the PKI's CA chain and the issued certificate's chain, with their CRLs, and
    the trusted certificates and CRLs the request keeps trusted beside them (another issuer's, in a campaign)."""
    trusted = [to_der(ca) for ca in (*pki.ca_certificates, *enrollment.chain)]
    crl_ders = [crl.public_bytes(serialization.Encoding.DER) for crl in crls]
    return TrustList(
        trusted_certificates=_unique([*trusted, *also_trusted.trusted_certificates]),
        trusted_crls=_unique([*crl_ders, *also_trusted.trusted_crls]),
    )


def issuer_lists_hold(trust_list: TrustList, wanted: TrustList) -> bool:
    """Whether the issuer lists of ``trust_list`` hold every issuer certificate and CRL of ``wanted``: the generic
    API writes only the trusted lists, so a device's issuer lists are what it holds itself."""
    return all(
        set(getattr(wanted, part)) <= set(getattr(trust_list, part)) for part in ("issuer_certificates", "issuer_crls")
    )


def merged_trust_list(
    ours: TrustList, on_device: TrustList, written_before: tuple[frozenset[str], frozenset[str]]
) -> tuple[TrustList, int]:
    """The trusted list to write: ``ours`` (the PKI's CAs and CRLs) and what the device holds that certlm did not
    write (in its last successful push, ``written_before`` as digests) nor replaces (a CRL of a CA in ``ours`` is
    superseded by ours). How many of the device's own certificates and CRLs were kept."""
    certificates_before, crls_before = written_before
    our_cas = {x509.load_der_x509_certificate(der).subject for der in ours.trusted_certificates}
    kept_certificates = [
        der for der, digest in zip(on_device.trusted_certificates, digests(on_device.trusted_certificates), strict=True)
        if der not in ours.trusted_certificates and digest not in certificates_before
    ]  # fmt: skip
    kept_crls = [
        der for der, digest in zip(on_device.trusted_crls, digests(on_device.trusted_crls), strict=True)
        if der not in ours.trusted_crls and digest not in crls_before
        and x509.load_der_x509_crl(der).issuer not in our_cas
    ]  # fmt: skip
    merged = TrustList(
        trusted_certificates=_unique([*ours.trusted_certificates, *kept_certificates]),
        trusted_crls=_unique([*ours.trusted_crls, *kept_crls]),
    )
    return merged, len(_unique(kept_certificates)) + len(_unique(kept_crls))


def still_written(trust_list: TrustList, written_before: tuple[frozenset[str], frozenset[str]]) -> TrustList:
    """What certlm's pushes wrote (``written_before``, as digests) that ``trust_list`` keeps: what certlm remembers as
    written after writing the list on its own. What such a write adds (a campaign's new issuer) is not a push's, so
    later pushes keep it, as they keep the device's own entries, until a write removes it."""
    certificates_before, crls_before = written_before
    return TrustList(
        trusted_certificates=_digested(trust_list.trusted_certificates, certificates_before),
        trusted_crls=_digested(trust_list.trusted_crls, crls_before),
    )


def device_chain(enrollment: Enrollment, pki: PkiMaterial) -> tuple[x509.Certificate, ...]:
    """The chain sent with the certificate: its issuer first, each CA followed by the one that issued it, without the
    self-signed root (the device trusts it through its trusted list)."""
    path = issuer_chain(enrollment.certificate, (*enrollment.chain, *pki.ca_certificates))
    return tuple(ca for ca in path if not is_self_signed(ca))


def check_trust_list_size(trust_list: TrustList, description: DeviceDescription) -> None:
    """Refuse a trust list larger than the device says it holds (``max_trust_list_bytes``, 0 or none: no limit)."""
    limit = description.capabilities.get("max_trust_list_bytes") or 0
    size = sum(len(item) for item in (*trust_list.trusted_certificates, *trust_list.trusted_crls))
    if isinstance(limit, int) and limit and size > limit:
        raise DeviceFailure(f"trust list too large: {size} bytes, the device holds at most {limit}", "TooLarge")


def checked_der(trust_list: TrustList) -> None:
    """A ``DeviceFailure`` naming the first item of ``trust_list`` that is not a DER certificate (a DER CRL in the
    CRL lists): such a list is refused before anything is sent."""
    for part, load in _DER_LOADERS.items():
        for index, item in enumerate(getattr(trust_list, part)):
            try:
                load(item)
            except (TypeError, ValueError):
                kind = "CRL" if part.endswith("crls") else "certificate"
                raise DeviceFailure(
                    f"{part}[{index}] of the trust list to write is not a DER {kind}: nothing was sent",
                    INVALID_TRUST_LIST,
                ) from None


def certlm_csr(
    key: rsa.RSAPrivateKey, subject: str | None, current: x509.Certificate, target: DeviceTarget
) -> x509.CertificateSigningRequest:
    """A CSR for a key certlm made: the requested subject (else the current certificate's), the current
    certificate's URIs (the OPC UA ApplicationUri) and the address certlm reaches the device at."""
    try:
        name = x509.Name.from_rfc4514_string(subject) if subject else current.subject
    except ValueError as error:
        raise DeviceFailure(f"subject {subject!r} is not an RFC 4514 distinguished name", BAD_ANSWER) from error
    try:
        san = current.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = [x509.UniformResourceIdentifier(uri) for uri in san.get_values_for_type(x509.UniformResourceIdentifier)]
    except x509.ExtensionNotFound:
        uris = []
    names: list[x509.GeneralName] = [*uris, host_general_name(target.server)]
    return (
        x509.CertificateSigningRequestBuilder()
        .subject_name(name)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )


def _as_stored(trust_list: TrustList) -> tuple[list[bytes], list[bytes]]:
    return sorted(trust_list.trusted_certificates), sorted(trust_list.trusted_crls)


_DER_LOADERS = {
    "trusted_certificates": x509.load_der_x509_certificate,
    "trusted_crls": x509.load_der_x509_crl,
    "issuer_certificates": x509.load_der_x509_certificate,
    "issuer_crls": x509.load_der_x509_crl,
}


def _digested(items: list[bytes], digests_wanted: frozenset[str]) -> list[bytes]:
    return [item for item, digest in zip(items, digests(items), strict=True) if digest in digests_wanted]


def _unique(items: Iterable[bytes]) -> list[bytes]:
    return list(dict.fromkeys(items))
