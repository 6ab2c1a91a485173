"""The SSH enrollment of one device, step by step: connect (host key pinned, or pinned now at an operator's onboarding),
identify (which driver and layout, and why), read the store, make the key and CSR (on the device with openssl where it
can), enroll, upload to a staging directory, swap the files in keeping the previous generation, reload the server,
verify over OPC UA that it presents the new certificate within the verify wait; when the install, reload or verify
fails, restore the kept generation, reload again and check the server presents the previous certificate."""

from __future__ import annotations

from contextlib import AsyncExitStack

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID

from certlm import (
    APIError,
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
    host_general_name,
    issued_by,
    plain_status,
    serial_hex,
    to_der,
)
from certlm_ssh.connection import (
    HostKeyNotPinned,
    SshSession,
    describe_error,
    host_key_fingerprint,
    host_key_text,
    offered_host_key,
    open_session,
    quoted,
)
from certlm_ssh.device_settings import DeviceSettings, device_settings, login_of, opcua_url_of, pin_host_key
from certlm_ssh.layout import StoreLayout
from certlm_ssh.opcua import await_certificate
from certlm_ssh.session_driver import SshSessionDriver, checked_trust_list
from certlm_ssh.store import (
    PREVIOUS,
    certificate_bytes,
    install_script,
    load_certificate_file,
    private_key_bytes,
    staged_path,
    staging_script,
    trust_files,
)

UNTRUSTED_STORE = "CertificateUntrusted"
NO_APPLICATION_URI = "NoApplicationUri"
_OPENSSL_KEYS = {
    "rsa2048": "-newkey rsa:2048",
    "rsa3072": "-newkey rsa:3072",
    "rsa4096": "-newkey rsa:4096",
    "ec-prime256v1": "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1",
    "ec-secp384r1": "-newkey ec -pkeyopt ec_paramgen_curve:secp384r1",
}


def step_status(error: BaseException) -> str:
    """A failed step's status: a PKI's refusal keeps its own (the host answers 422 for CsrRejected), a device error
    is named in SSH terms."""
    return plain_status(error) if isinstance(error, APIError) else describe_error(error)[0]


def step_explanation(error: BaseException) -> str:
    """A failed step's reason, in SSH terms where the error is not already certlm's."""
    return error.message if isinstance(error, APIError) else describe_error(error)[1]


def layout_summary(layout: StoreLayout) -> str:
    """Where a layout keeps the certificate, key and trust list, for the operator to compare with the device."""
    return (
        f"store {layout.root}: certificate {layout.own_certs}/{layout.certificate_file} ({layout.certificate_format}), "
        f"key {layout.own_private}/{layout.private_key_file} ({layout.private_key_format}), trust list "
        f"{layout.trust_format}; reload: {layout.reload_command}"
    )


def driver_choice(description: DeviceDescription, before: SshSessionDriver, chosen: SshSessionDriver) -> str:
    """Which driver the device's description selected, and why."""
    identity = description.identity
    said = f"the device says {identity.manufacturer or '?'} / {identity.product or '?'} / {identity.firmware or '?'}"
    if chosen.generic:
        why = f"no installed SSH driver supports it: {chosen.service}"
    else:
        supported = next((device for device in chosen.supported_devices if device.matches(identity)), None)
        versions = ", ".join(supported.firmware_versions) if supported else identity.firmware
        why = f"{chosen.service} supports it (firmware {versions})"
    switched = f", instead of {before.service}" if chosen.service != before.service else ""
    return f"{said}; {why}{switched}"


class SshPush:
    """One push: its steps on the host's ``StepLog``, and what the device said of itself."""

    def __init__(self, driver: SshSessionDriver, target: DeviceTarget, request: PushRequest, pki: PkiMaterial) -> None:
        self.driver = driver
        self.target = target
        self.request = request
        self.pki = pki
        self.run = StepLog(status_of=step_status, explain=step_explanation)
        self.description: DeviceDescription | None = None
        self.choice: str | None = None

    async def push(self) -> PushOutcome:
        settings = await device_settings(self.target.entry_id, self.driver.services.secrets)
        async with AsyncExitStack() as stack:
            return await self._push(stack, settings)

    async def _push(self, stack: AsyncExitStack, settings: DeviceSettings) -> PushOutcome:
        driver, timeouts, run = self.driver, self.driver.services.device_timeouts, self.run
        host_key = settings.host_key

        async with run.step("connect") as note:
            pin_now = host_key is None
            if host_key is None:
                # Pinning is an operator's act: an onboarding, or POST /ssh/hostkey. A renewal, even one an operator
                # asks for, and every automated run only ever verify.
                if not (self.request.onboarding and self.request.trust_on_first_use):
                    raise HostKeyNotPinned(
                        f"{self.target.url} has no pinned SSH host key, and only an operator's onboarding pins one: "
                        f'pin it with POST /ssh/hostkey {{"server": "{self.target.server}", "port": '
                        f'{self.target.port}, "fingerprint": "SHA256:..."}} (the fingerprint read on the device\'s '
                        "console), or onboard the device (POST /gds/push/onboarding)"
                    )
                host_key = host_key_text(await offered_host_key(self.target.server, self.target.port, timeouts))
            session = await stack.enter_async_context(open_session(login_of(self.target, settings), host_key, timeouts))
            if pin_now and self.target.entry_id is not None:
                await pin_host_key(self.target.entry_id, host_key)
                note.message = f"SSH host key {host_key_fingerprint(host_key)} pinned by the operator's onboarding"

        layout = driver.layout_for(settings)
        if self.request.identify is not None:
            async with run.step("identify") as note:
                description = self.description = await driver.describe_in(session, layout)
                chosen = await self.request.identify(description)
                if isinstance(chosen, SshSessionDriver):
                    # The driver selected for what the device said goes on in this session, with its own layout.
                    self.choice = driver_choice(description, driver, chosen)
                    driver, layout = chosen, chosen.layout_for(settings)
                overrides = f"; the entry overrides {', '.join(sorted(settings.layout))}" if settings.layout else ""
                note.message = f"{self.choice or driver.service}. Layout: {layout_summary(layout)}{overrides}"

        async with run.step("read_store") as note:
            current = await self._read_store(session, layout)
            path = layout.path("own_certs", layout.certificate_file)
            note.message = f"{path}: " + (f"serial {serial_hex(current)}" if current else "no certificate there")
        async with run.step("csr") as note:
            application_uri = await self._application_uri(session, layout, current, settings)
            csr, key = await self._make_csr(session, layout, current, application_uri)
            note.message = "key made on the device (openssl)" if key is None else "key made by certlm, to be uploaded"
        async with run.step("enroll"):
            enrollment = await self.pki.enroll(csr, key)
        for warning in enrollment.warnings:
            run.warn("enroll", warning)
        async with run.step("upload"):
            await self._upload(session, layout, enrollment, key)
        run.changed_device = True
        url = opcua_url_of(self.target, settings, layout)
        wait_s = layout.reload_timeout_s or driver.verify_wait_s
        try:
            async with run.step("install"):
                await session.run(install_script(layout), name="the install script")
            async with run.step("reload"):
                await session.run(layout.reload_command)
            async with run.step("verify") as note:
                waited = await await_certificate(url, enrollment.certificate, wait_s, timeouts.connect_s)
                note.message = f"{url} presents the new certificate (after {waited:.1f} s)"
        except PushFailed as stopped:
            await self._roll_back(settings, host_key, layout, url, current, wait_s)
            raise PushFailed(
                stopped.message,
                run.steps,
                changed_device=run.changed_device,
                presented_certificate=run.presented_certificate,
            ) from stopped.__cause__
        trust_list = await driver.read_trust_list_in(session, layout)
        return run.outcome(enrollment, trust_list, description=self.description)

    async def _read_store(self, session: SshSession, layout: StoreLayout) -> x509.Certificate | None:
        """The certificate in the store; a pinned device's must be the pinned one or one of the entry's PKI."""
        data = await session.read_file(layout.path("own_certs", layout.certificate_file))
        current = load_certificate_file(data) if data else None
        self.run.presented_certificate = current
        pinned = self.request.pinned_certificate
        if current is None or self.request.trust_on_first_use or pinned is None or to_der(current) == pinned:
            return current
        if any(issued_by(current, ca) for ca in self.request.trusted_cas):
            return current
        raise DeviceFailure(
            f"the store holds a certificate certlm did not install (serial {serial_hex(current)}, issued by "
            f"{current.issuer.rfc4514_string()}): an operator pushes to the device or onboards it again",
            UNTRUSTED_STORE,
        )

    async def _application_uri(
        self, session: SshSession, layout: StoreLayout, current: x509.Certificate | None, settings: DeviceSettings
    ) -> str:
        """The ApplicationUri the new certificate names: the current certificate's, else the entry's; when neither
        is known, the failure names the path that was read and what the directory holds instead."""
        if current is not None:
            try:
                uris = current.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                found = uris.get_values_for_type(x509.UniformResourceIdentifier)
            except x509.ExtensionNotFound:
                found = []
            if found:
                return found[0]
        if settings.application_uri:
            return settings.application_uri
        path = layout.path("own_certs", layout.certificate_file)
        if current is not None:
            read = f"the certificate at {path} names no ApplicationUri"
        else:
            others = await session.list_files(layout.path("own_certs"))
            held = f"the directory holds {', '.join(others)}" if others else "the directory holds no file"
            read = (
                f"there is no certificate at {path} ({held}; layout of {self.choice or self.driver.service}: set "
                "layout.certificate_file and layout.certificate_format with POST /ssh/device if the server keeps it "
                "elsewhere)"
            )
        raise DeviceFailure(
            f"{read}, and the entry has no application_uri for a first certificate: set application_uri with "
            "POST /ssh/device",
            NO_APPLICATION_URI,
        )

    def _subject(self, current: x509.Certificate | None) -> x509.Name:
        if self.request.subject:
            return x509.Name.from_rfc4514_string(self.request.subject)
        if current is not None:
            return current.subject
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.target.server)])

    def _alt_names(self, current: x509.Certificate | None, application_uri: str) -> list[x509.GeneralName]:
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(application_uri)]
        if current is not None:
            try:
                san = current.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                names += [n for n in san if isinstance(n, x509.DNSName | x509.IPAddress)]
            except x509.ExtensionNotFound:
                pass
        host = host_general_name(self.target.server)
        if host not in names:
            names.append(host)
        return names

    async def _make_csr(
        self, session: SshSession, layout: StoreLayout, current: x509.Certificate | None, application_uri: str
    ) -> tuple[x509.CertificateSigningRequest, CertificateIssuerPrivateKeyTypes | None]:
        """The CSR, its key made on the device (None returned) where the layout says it can and openssl is there,
        else here (returned, to be uploaded)."""
        subject = self._subject(current)
        names = self._alt_names(current, application_uri)
        await session.run(staging_script(layout), name="making the staging directory")
        if layout.device_makes_key and (await session.run("command -v openssl", check=False)).strip():
            pem = await session.run(_openssl_request(layout, subject, names), name="openssl req on the device")
            return x509.load_pem_x509_csr(pem.encode()), None
        key = _new_key(layout.key_type)
        builder = x509.CertificateSigningRequestBuilder().subject_name(subject)
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(key, hashes.SHA256()), key

    async def _upload(
        self,
        session: SshSession,
        layout: StoreLayout,
        enrollment: Enrollment,
        key: CertificateIssuerPrivateKeyTypes | None,
    ) -> None:
        files = {staged_path(layout, "own_certs", layout.certificate_file): (
            certificate_bytes(enrollment.certificate, layout.certificate_format), 0o644,
        )}  # fmt: skip
        if key is not None:
            files[staged_path(layout, "own_private", layout.private_key_file)] = (
                private_key_bytes(key, layout.private_key_format), 0o600,
            )  # fmt: skip
        for directory, named in trust_files(layout, await self._trust_list(enrollment)).items():
            for name, content in named.items():
                files[staged_path(layout, directory, name)] = (content, 0o644)
        await session.upload(files)

    async def _trust_list(self, enrollment: Enrollment) -> TrustList:
        """What the push writes into the trust directories: the PKI's CA certificates (else the issued chain) and
        their CRLs as trusted, the chain's other certificates as issuers, and beside them everything the request's
        ``also_trusted`` holds, in the lists of the same names."""
        trusted = self.pki.ca_certificates or enrollment.chain
        crls = list(self.pki.crls)
        if self.pki.chain_crls is not None:
            chain_crls = await self.pki.chain_crls(enrollment)
            crls = list(chain_crls.crls)
            for missing in chain_crls.missing:
                self.run.warn("enroll", missing)
        issuers = [c for c in enrollment.chain if c not in trusted]
        also = checked_trust_list(self.request.also_trusted, "the push's also_trusted")
        return TrustList(
            trusted_certificates=[to_der(c) for c in trusted] + list(also.trusted_certificates),
            trusted_crls=[crl.public_bytes(Encoding.DER) for crl in crls] + list(also.trusted_crls),
            issuer_certificates=[to_der(c) for c in issuers] + list(also.issuer_certificates),
            issuer_crls=list(also.issuer_crls),
        )

    async def _roll_back(
        self, settings: DeviceSettings, host_key: str, layout: StoreLayout, url: str,
        previous: x509.Certificate | None, wait_s: float,
    ) -> None:  # fmt: skip
        """Restore the kept generation and reload, in a new session (the push's may be gone with the device). The
        device is unchanged once its files are restored and its server presents the previous certificate, whether or
        not the reload went through (a server that a failed reload never stopped still runs on the old files)."""
        timeouts = self.driver.services.device_timeouts
        try:
            async with self.run.step("rollback") as note:
                async with open_session(login_of(self.target, settings), host_key, timeouts) as session:
                    restoration = await self.driver.restore_in(session, layout)
                if not restoration.swapped:
                    note.message = "the install stopped before it changed the store: nothing to restore"
                    self.run.changed_device = False
                    return
                reload_failed = restoration.reload_failure
                reloaded = f"the reload after the restore failed ({reload_failed}), but " if reload_failed else ""
                if previous is None:
                    if reload_failed is not None:
                        raise reload_failed
                    note.message = "previous files restored (the store had no certificate before)"
                else:
                    waited = await await_certificate(
                        url, previous, wait_s, timeouts.connect_s, "the previous certificate"
                    )
                    note.message = (
                        f"previous files restored and kept in {PREVIOUS}; {reloaded}the server presents the previous "
                        f"certificate (serial {serial_hex(previous)}, after {waited:.1f} s)"
                    )
        except PushFailed:
            return
        self.run.changed_device = False


def _new_key(key_type: str) -> CertificateIssuerPrivateKeyTypes:
    if key_type.startswith("rsa"):
        return rsa.generate_private_key(public_exponent=65537, key_size=int(key_type[3:]))
    curve = ec.SECP256R1() if key_type == "ec-prime256v1" else ec.SECP384R1()
    return ec.generate_private_key(curve)


def _subject_argument(subject: x509.Name) -> str:
    """``subject`` as openssl's ``-subj`` (``/CN=x/O=y``), special characters escaped."""
    parts = []
    for rdn in subject.rdns:
        for attribute in rdn:
            name = attribute.rfc4514_attribute_name
            value = str(attribute.value).replace("\\", "\\\\").replace("/", "\\/").replace("+", "\\+")
            parts.append(f"/{name}={value}")
    return "".join(parts) or "/"


def _san_argument(names: list[x509.GeneralName]) -> str:
    rendered = []
    for name in names:
        if isinstance(name, x509.UniformResourceIdentifier):
            rendered.append(f"URI:{name.value}")
        elif isinstance(name, x509.DNSName):
            rendered.append(f"DNS:{name.value}")
        elif isinstance(name, x509.IPAddress):
            rendered.append(f"IP:{name.value}")
    return "subjectAltName=" + ",".join(rendered)


def _openssl_request(layout: StoreLayout, subject: x509.Name, names: list[x509.GeneralName]) -> str:
    """The command that makes the key in the staging directory (never readable by others) and prints the CSR."""
    key = staged_path(layout, "own_private", layout.private_key_file)
    made = f"{key}.new"
    command = (
        f"umask 077 && openssl req -new {_OPENSSL_KEYS[layout.key_type]} -nodes -keyout {quoted(made)} -utf8 "
        f"-subj {quoted(_subject_argument(subject))} -addext {quoted(_san_argument(names))} -outform PEM 2>/dev/null"
    )
    form = "DER" if layout.private_key_format == "DER" else "PEM"
    return f"{command} && openssl pkey -in {quoted(made)} -outform {form} -out {quoted(key)} && rm -f {quoted(made)}"


async def run_push(
    driver: SshSessionDriver, target: DeviceTarget, request: PushRequest, pki: PkiMaterial
) -> PushOutcome:
    return await SshPush(driver, target, request, pki).push()
