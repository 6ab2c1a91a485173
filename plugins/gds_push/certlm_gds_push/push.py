"""The GDS push flow: one enrollment in one session with the device, through OPC UA Part 12 push management.

connect → describe → create_signing_request (or generate_key) → enroll → fetch_crls → write_trust_list →
update_certificate → apply_changes → verify. The trust list goes first, as Part 12 (v1.05, 7.7) and the OPC
Foundation's push client do: servers refuse to open it while a certificate update is pending, and servers that
check revocation refuse a certificate whose CA and CRL they do not hold yet. Every list certlm writes keeps certlm
trusted, so a failure after it was written still leaves a device certlm can reach. A device that needs
ApplyChanges keeps running on what it had until then: a failure before that point cancels the pending changes,
and its ``PushFailed`` says whether the device was changed (a device that applies a trust list or certificate at
once is).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from asyncua import ua
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import NameOID

from certlm.certs import issued_by, sha1_fingerprint, to_der
from certlm.drivers import DeviceTarget, PkiMaterial, PushFailed, PushOutcome, PushRequest, StepOutcome, TrustList
from certlm.errors import UnsupportedOperation
from certlm.pki_backends import Enrollment
from certlm_gds_push.connection import (
    DeviceError,
    DeviceSession,
    Endpoint,
    ServerCheck,
    SessionSecurity,
    explain,
    status_name,
)
from certlm_gds_push.identity import ClientIdentity
from certlm_gds_push.trustlist import TrustListFile, encode, from_data_type, to_data_type

if TYPE_CHECKING:
    from certlm_gds_push.driver import GdsPushDriver

log = logging.getLogger(__name__)

DEFAULT_APPLICATION_GROUP = ua.NodeId(ua.ObjectIds.ServerConfiguration_CertificateGroups_DefaultApplicationGroup)
RSA_SHA256_APPLICATION_CERTIFICATE_TYPE = ua.NodeId(ua.ObjectIds.RsaSha256ApplicationCertificateType)
# Answers to CreateSigningRequest meaning "this device cannot make a CSR": certlm makes the key pair instead.
NO_CSR_STATUSES = frozenset({"BadNotSupported", "BadNotImplemented", "BadMethodInvalid"})
# certlm writes the lists it owns: trusted certificates and their CRLs. The issuer lists stay as the device has them.
WRITTEN_LISTS = TrustList.MASK_BITS["trusted_certificates"] | TrustList.MASK_BITS["trusted_crls"]
GENERATED_KEY_BITS = 2048
VERIFY_RETRY_S = 0.5


async def push_certificate(
    driver: GdsPushDriver, target: DeviceTarget, request: PushRequest, pki: PkiMaterial
) -> PushOutcome:
    """Enroll a new application certificate for the device's DefaultApplicationGroup; see the module docstring."""
    identity = await driver.client_identity()
    run = StepLog()
    async with AsyncExitStack() as connection:
        async with run.step("connect") as note:
            session = await connection.enter_async_context(
                driver.session(target, SessionSecurity.ENCRYPTED, known_device_check(request))
            )
            run.presented_certificate = session.server_certificate
            note.message = f"{session.endpoint.name}, the device presents {_name(session.server_certificate)}"
        configuration = ServerConfiguration(session)  # the well-known NodeIds, should describe fail
        try:
            async with run.step("describe") as note:
                description = await driver.read_description(session)
                configuration = await ServerConfiguration.locate(session)
                if not configuration.present:
                    raise DeviceError(
                        "the device has no ServerConfiguration object: it does not offer Part 12 push management",
                        "BadNotSupported",
                    )
                certificate_type = driver.certificate_type(description)
                device = description.identity
                note.message = f"{device.manufacturer} {device.product} {device.firmware}"

            # What certlm can refuse on its own it refuses before the device is asked for anything.
            trust_list = planned_trust_list(request, pki, identity)
            try:
                check_trust_list(trust_list, driver.trust_list_limit(description))
            except DeviceError as error:
                run.fail("write_trust_list", error)

            csr: x509.CertificateSigningRequest | None = None
            if driver.device_makes_csr:
                async with run.step("create_signing_request") as note:
                    subject = driver.csr_subject(request.subject)
                    try:
                        csr = x509.load_der_x509_csr(
                            await configuration.create_signing_request(certificate_type, subject)
                        )
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
                    key_format = driver.private_key_format(description)
                    private_key = await asyncio.to_thread(
                        rsa.generate_private_key, public_exponent=65537, key_size=GENERATED_KEY_BITS
                    )
                    csr = certlm_csr(private_key, request.subject, session, target)
                    note.message = f"RSA {GENERATED_KEY_BITS} key pair made in certlm, sent as {key_format}"

            async with run.step("enroll") as note:
                enrollment, private_key = await enroll(pki, csr, private_key, note)
                note.message = f"issued {_name(enrollment.certificate)}{note.message}"
            for warning in enrollment.warnings:
                run.warn("check_names", warning)

            if not issuer_known(enrollment.certificate, (*enrollment.chain, *pki.ca_certificates)):
                run.fail(
                    "enroll",
                    DeviceError(
                        f"the PKI issued {_name(enrollment.certificate)} but sent no certificate of its issuer "
                        f"{enrollment.certificate.issuer.rfc4514_string()}, and none is known: the device could not "
                        "verify it",
                        "BadCertificateChainIncomplete",
                    ),
                )
            # Now that the chain is known (a PKI may hand it out only with a certificate, as CMP caPubs), the plan
            # gets it and the CRL of every CA on it: a device that checks revocation needs them all.
            crls = pki.crls
            if pki.chain_crls is not None:
                async with run.step("fetch_crls") as note:
                    chain_crls = await pki.chain_crls(enrollment)
                    crls = chain_crls.crls
                    note.message = f"{len(crls)} CRLs for the chain" + "".join(
                        f"; {missing} (devices that check revocation will refuse the certificate)"
                        for missing in chain_crls.missing
                    )
            if not set(enrollment.chain) <= set(pki.ca_certificates) or crls != pki.crls:
                trust_list = planned_trust_list(request, pki, identity, enrollment.chain, crls)
                try:
                    check_trust_list(trust_list, driver.trust_list_limit(description))
                except DeviceError as error:
                    run.fail("write_trust_list", error)

            async with run.step("write_trust_list") as note:
                trust_file = await TrustListFile.locate(session, configuration.group_id)
                apply_required = await trust_file.write(to_data_type(trust_list, WRITTEN_LISTS))
                # A device that applies CloseAndUpdate at once is changed from here on (and still trusts certlm).
                run.changed_device |= not apply_required
                note.message = (
                    f"{len(trust_list.trusted_certificates)} trusted certificates, {len(trust_list.trusted_crls)} "
                    f"CRLs, {_pending_or_applied(apply_required)}"
                )

            async with run.step("update_certificate") as note:
                key_blob = private_key_blob(private_key, key_format, enrollment) if private_key else b""
                certificate_pending = await configuration.update_certificate(
                    certificate_type, enrollment, key_format, key_blob
                )
                run.changed_device |= not certificate_pending
                apply_required |= certificate_pending
                note.message = _pending_or_applied(certificate_pending)

            async with run.step("apply_changes") as note:
                if apply_required:
                    await configuration.apply_changes(run)
                    await driver.after_apply_changes(session)
                else:
                    note.message = "not needed: the device applied the changes at once"
        except PushFailed:
            if not run.changed_device:
                await configuration.cancel_changes()
            raise

    async with run.step("verify") as note:
        await asyncio.sleep(driver.apply_settle_s)
        endpoint = await presented_after_apply(driver, target, enrollment.certificate)
        trust_list_read_back = await confirm_trust_list(driver, target, configuration.group_id, trust_list)
        note.message = f"the device presents the issued certificate on {endpoint.name}; {trust_list_read_back}"
    return PushOutcome(
        presented_certificate=run.presented_certificate,
        certificate=enrollment.certificate,
        chain=enrollment.chain,
        trust_list=trust_list,
        security_policy=endpoint.policy_bit,
        security_mode=endpoint.mode_bit,
        steps=run.steps,
        description=description,
    )


def _pending_or_applied(pending: bool) -> str:
    return "pending until ApplyChanges" if pending else "applied by the device at once"


@dataclass
class StepNote:
    """What a step reports when it succeeds."""

    message: str = ""
    status: str = ""


@dataclass
class StepLog:
    """The steps of one push as they happen. The first failure becomes ``PushFailed``, raised from the original
    error, with every step so far and whether the device was already changed."""

    steps: list[StepOutcome] = field(default_factory=list)
    changed_device: bool = False
    presented_certificate: x509.Certificate | None = None

    @asynccontextmanager
    async def step(self, name: str) -> AsyncIterator[StepNote]:
        note, started = StepNote(), time.monotonic()
        try:
            yield note
        except PushFailed:
            raise
        except Exception as error:
            self.fail(name, error, started)
        self.steps.append(StepOutcome(name, True, time.monotonic() - started, note.status, note.message))

    def warn(self, name: str, message: str) -> None:
        """A step that goes through with something the operator should know."""
        self.steps.append(StepOutcome(name, True, 0.0, message=message, warning=True))

    def fail(self, name: str, error: Exception, started: float | None = None) -> NoReturn:
        seconds = time.monotonic() - started if started is not None else 0.0
        message = failed_step_message(name, error)
        self.steps.append(StepOutcome(name, False, seconds, status_name(error), message))
        raise PushFailed(
            message,
            list(self.steps),
            changed_device=self.changed_device,
            presented_certificate=self.presented_certificate,
        ) from error


class ServerConfiguration:
    """The device's ServerConfiguration object and its DefaultApplicationGroup, found by browsing from the Server
    object; where a browse path does not resolve, the well-known ns=0 NodeId stands in."""

    METHODS = ("CreateSigningRequest", "UpdateCertificate", "ApplyChanges", "CancelChanges")
    PROPERTIES = ("SupportedPrivateKeyFormats", "MaxTrustListSize", "ServerCapabilities")

    def __init__(self, session: DeviceSession) -> None:
        self.session = session
        self.present = False
        self.node_id = ua.NodeId(ua.ObjectIds.ServerConfiguration)
        self.groups_id = ua.NodeId(ua.ObjectIds.ServerConfiguration_CertificateGroups)
        self.group_id = DEFAULT_APPLICATION_GROUP
        self.nodes = {
            name: ua.NodeId(getattr(ua.ObjectIds, f"ServerConfiguration_{name}"))
            for name in self.METHODS + self.PROPERTIES
        }

    @classmethod
    async def locate(cls, session: DeviceSession) -> ServerConfiguration:
        """Resolve every node the push flow uses in one TranslateBrowsePathsToNodeIds request."""
        configuration = cls(session)
        names = cls.METHODS + cls.PROPERTIES
        found = await session.translate(
            ua.NodeId(ua.ObjectIds.Server),
            ["0:ServerConfiguration"],
            ["0:ServerConfiguration", "0:CertificateGroups"],
            ["0:ServerConfiguration", "0:CertificateGroups", "0:DefaultApplicationGroup"],
            *(["0:ServerConfiguration", f"0:{name}"] for name in names),
        )
        configuration.present = found[0] is not None
        configuration.node_id = found[0] or configuration.node_id
        configuration.groups_id = found[1] or configuration.groups_id
        configuration.group_id = found[2] or configuration.group_id
        configuration.nodes |= {name: node_id for name, node_id in zip(names, found[3:], strict=True) if node_id}
        return configuration

    async def capabilities(self) -> dict[str, Any]:
        """SupportedPrivateKeyFormats, MaxTrustListSize, ServerCapabilities and the certificate groups with their
        CertificateTypes, as JSON data; ``{"push_management": False}`` when the device has no ServerConfiguration."""
        if not self.present:
            return {"push_management": False}
        key_formats, max_size, server_capabilities = await self.session.read_values(
            [self.nodes[name] for name in self.PROPERTIES]
        )
        groups = await self.session.children(self.groups_id)
        type_nodes = await self.session.translate(
            self.groups_id,
            *([f"{group.BrowseName.NamespaceIndex}:{group.BrowseName.Name}", "0:CertificateTypes"] for group in groups),
        )
        present = [node for node in type_nodes if node is not None]
        types_by_node = dict(zip(present, await self.session.read_values(present), strict=True))
        return {
            "push_management": True,
            "supported_private_key_formats": list(key_formats or []),
            "max_trust_list_size": int(max_size or 0),
            "server_capabilities": list(server_capabilities or []),
            "certificate_groups": [
                {
                    "name": group.BrowseName.Name,
                    "node_id": group.NodeId.to_string(),
                    "certificate_types": [type_name(t) for t in types_by_node.get(node) or []],
                }
                for group, node in zip(groups, type_nodes, strict=True)
            ],
        }

    async def _call(self, method: str, *arguments: ua.Variant) -> list[Any]:
        return await self.session.call(self.node_id, self.nodes[method], *arguments)

    async def create_signing_request(self, certificate_type: ua.NodeId, subject: str) -> bytes:
        """A CSR (DER) for a new key pair the device makes, regeneratePrivateKey with the 32 bytes of client entropy
        Part 12 asks for as nonce; an empty ``subject`` keeps the device's current one."""
        (csr,) = await self._call(
            "CreateSigningRequest",
            ua.Variant(self.group_id, ua.VariantType.NodeId),
            ua.Variant(certificate_type, ua.VariantType.NodeId),
            ua.Variant(subject, ua.VariantType.String),
            ua.Variant(True, ua.VariantType.Boolean),
            ua.Variant(os.urandom(32), ua.VariantType.ByteString),
        )
        return csr

    async def update_certificate(
        self, certificate_type: ua.NodeId, enrollment: Enrollment, key_format: str, key: bytes
    ) -> bool:
        """Install the issued certificate with its issuer chain (and the key, when certlm made it); whether the device
        needs ApplyChanges."""
        outputs = await self._call(
            "UpdateCertificate",
            ua.Variant(self.group_id, ua.VariantType.NodeId),
            ua.Variant(certificate_type, ua.VariantType.NodeId),
            ua.Variant(to_der(enrollment.certificate), ua.VariantType.ByteString),
            ua.Variant([to_der(issuer) for issuer in enrollment.chain], ua.VariantType.ByteString),
            ua.Variant(key_format, ua.VariantType.String),
            ua.Variant(key, ua.VariantType.ByteString),
        )
        return bool(outputs and outputs[0])

    async def apply_changes(self, run: StepLog) -> None:
        # Unless the device answers with a refusal it may have switched: it counts as changed from the call on.
        run.changed_device = True
        try:
            await self._call("ApplyChanges")
        except ua.UaStatusCodeError:
            run.changed_device = False
            raise

    async def cancel_changes(self) -> None:
        """Discard pending changes, best effort: closing the session right after discards them as well."""
        url = self.session.client.server_url.geturl()
        try:
            await asyncio.wait_for(self._call("CancelChanges"), self.session.timeouts.connect_s)
        except ua.UaStatusCodeError as error:
            # Devices without CancelChanges, and devices with nothing pending, are fine.
            if status_name(error) not in {"BadMethodInvalid", "BadNotImplemented", "BadNotSupported", "BadNothingToDo"}:
                log.warning("CancelChanges on %s: %s", url, status_name(error))
        except Exception as error:
            log.info("CancelChanges on %s: %s", url, status_name(error))


def type_name(node_id: ua.NodeId) -> str:
    """A certificate type as capabilities show it: its ns=0 name, else the NodeId string."""
    if node_id.NamespaceIndex == 0 and node_id.Identifier in ua.ObjectIdNames:
        return ua.ObjectIdNames[node_id.Identifier]
    return node_id.to_string()


def failed_step_message(step: str, error: BaseException) -> str:
    """``"<step> failed: <why>"``, without repeating a prefix the error's own message already has."""
    prefix = f"{step} failed: "
    return explain(error) if explain(error).startswith(prefix) else prefix + explain(error)


def known_device_check(request: PushRequest) -> ServerCheck | None:
    """Unless the request trusts the device on first contact, it must present the pinned certificate or one issued
    by the PKI's CAs; a device that presents anything else gets nothing, not even the user's password."""
    if request.trust_on_first_use:
        return None

    def check(certificate: x509.Certificate) -> None:
        if request.pinned_certificate is not None and to_der(certificate) == request.pinned_certificate:
            return
        if any(issued_by(certificate, ca) for ca in request.trusted_cas):
            return
        expected = []
        if request.pinned_certificate is not None:
            pinned = x509.load_der_x509_certificate(request.pinned_certificate)
            expected.append(f"its pinned certificate {_name(pinned)}")
        if request.trusted_cas:
            cas = "; ".join(_name(ca) for ca in request.trusted_cas)
            expected.append(f"a certificate issued by the PKI's CA {cas}")
        raise DeviceError(
            f"the device presents {_name(certificate)}, but certlm expects {' or '.join(expected) or 'a pinned one'}"
            ": nothing was sent to it. If the device was replaced or reset, re-onboard it (POST /gds/push/onboarding)"
            " to accept the certificate it presents now",
            "BadCertificateUntrusted",
        )

    return check


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
    """The trusted lists certlm writes: the PKI's CA chain and CRLs, plus certlm's client certificate or its issuers
    as the request asks. The device must keep accepting certlm after ApplyChanges, or no later renewal could reach
    it: when neither the request nor the PKI's chain makes it trust certlm, certlm's own certificate is added (the
    narrowest trust that does; ``issuer`` widens it to certlm's CA so renewals of certlm's certificate keep working).
    """
    trusted = [to_der(ca) for ca in (*pki.ca_certificates, *chain)]
    if request.add_issuer or (request.onboarding and not identity.self_signed):
        trusted += [to_der(issuer) for issuer in identity.chain]
    if request.add_client_certificate or not _trusts(trusted, identity):
        trusted.append(identity.certificate_der)
    crl_ders = [crl.public_bytes(serialization.Encoding.DER) for crl in (pki.crls if crls is None else crls)]
    return TrustList(trusted_certificates=_unique(trusted), trusted_crls=_unique(crl_ders))


def _trusts(trusted: list[bytes], identity: ClientIdentity) -> bool:
    return identity.certificate_der in trusted or any(to_der(issuer) in trusted for issuer in identity.chain)


def check_trust_list(trust_list: TrustList, limit: int) -> None:
    """Refuse a trust list the device cannot hold, before anything is sent."""
    size = len(encode(to_data_type(trust_list, WRITTEN_LISTS)))
    if limit and size > limit:
        raise DeviceError(
            f"trust list too large: {size} bytes, the device accepts at most {limit}", "BadRequestTooLarge"
        )


def _unique(items: Iterable[bytes]) -> list[bytes]:
    return list(dict.fromkeys(items))


def part12_subject(subject: str | None, separator: str = "/") -> str:
    """An RFC 4514 DN (``CN=a,O=b``, escapes allowed) as CreateSigningRequest's subjectName (``CN=a/O=b``, values with
    the separator or ``=`` in double quotes, Part 12 7.10.7); ``""`` keeps the device's current subject."""
    if not subject:
        return ""
    try:
        name = x509.Name.from_rfc4514_string(subject)
    except ValueError as error:
        raise DeviceError(f"subject {subject!r} is not an RFC 4514 distinguished name", "BadInvalidArgument") from error
    parts = []
    for rdn in reversed(name.rdns):  # RFC 4514 lists the most specific RDN first; keep the order the user wrote
        for attribute in rdn:
            value = str(attribute.value)
            if '"' in value:
                raise DeviceError(
                    f"subject value {value!r} holds a '\"', which Part 12 cannot express", "BadInvalidArgument"
                )
            if separator in value or "=" in value:
                value = f'"{value}"'
            key = "S" if attribute.oid == NameOID.STATE_OR_PROVINCE_NAME else attribute.rfc4514_attribute_name
            parts.append(f"{key}={value}")
    return separator.join(parts)


def certlm_csr(
    key: rsa.RSAPrivateKey, subject: str | None, session: DeviceSession, target: DeviceTarget
) -> x509.CertificateSigningRequest:
    """A CSR for a key certlm made: the requested subject (else the device's current one), the device's
    ApplicationUri as URI SAN and the address certlm reaches it at."""
    try:
        name = x509.Name.from_rfc4514_string(subject) if subject else session.server_certificate.subject
    except ValueError as error:
        raise DeviceError(f"subject {subject!r} is not an RFC 4514 distinguished name", "BadInvalidArgument") from error
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(session.endpoint.description.Server.ApplicationUri)]
    try:
        names.append(x509.IPAddress(ipaddress.ip_address(target.server)))
    except ValueError:
        names.append(x509.DNSName(target.server))
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


async def presented_after_apply(driver: GdsPushDriver, target: DeviceTarget, issued: x509.Certificate) -> Endpoint:
    """Reconnect with fresh clients until the device presents ``issued`` on a SignAndEncrypt session, within the
    operation time-out (a device restarts its endpoints some time after ApplyChanges)."""
    issued_der = to_der(issued)

    def check(certificate: x509.Certificate) -> None:
        if to_der(certificate) != issued_der:
            raise DeviceError(
                f"the device still presents {_name(certificate)}, not the issued certificate", "BadCertificateInvalid"
            )

    deadline = time.monotonic() + driver.timeouts.operation_s
    while True:
        try:
            async with driver.session(target, SessionSecurity.ENCRYPTED, check) as session:
                return session.endpoint
        except Exception:
            if time.monotonic() + VERIFY_RETRY_S > deadline:
                raise
        await asyncio.sleep(VERIFY_RETRY_S)


async def confirm_trust_list(
    driver: GdsPushDriver, target: DeviceTarget, group_id: ua.NodeId, written: TrustList
) -> str:
    """Read the trusted lists back and raise when they are not what was written (stock node-opcua, for one, answers
    CloseAndUpdate with Good and keeps its old list). A device that does not let them be read is only noted."""
    try:
        async with driver.session(target, SessionSecurity.ENCRYPTED) as session:
            trust_file = await TrustListFile.locate(session, group_id)
            on_device = from_data_type(await trust_file.read(WRITTEN_LISTS), WRITTEN_LISTS)
    except Exception as error:
        return f"its trust list could not be read back ({explain(error)})"
    # Devices store a trust list as they like (node-opcua as files named by thumbprint): the order may change.
    if _as_stored(on_device) != _as_stored(written):
        raise DeviceError(
            "the device presents the issued certificate, but its trusted certificates and CRLs are not the ones "
            f"written ({len(on_device.trusted_certificates)} certificates and {len(on_device.trusted_crls)} CRLs "
            f"instead of {len(written.trusted_certificates)} and {len(written.trusted_crls)}): it did not apply "
            "CloseAndUpdate",
            "BadInvalidState",
        )
    return "its trust list reads back as written"


def _as_stored(trust_list: TrustList) -> tuple[list[bytes], list[bytes]]:
    return sorted(trust_list.trusted_certificates), sorted(trust_list.trusted_crls)


def _name(certificate: x509.Certificate) -> str:
    return f"{certificate.subject.rfc4514_string()} (SHA-1 {sha1_fingerprint(certificate)})"
