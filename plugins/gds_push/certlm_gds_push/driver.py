"""``GdsPushDriver``: the generic OPC UA push management driver (``gds-push-generic``) and the base class of
device- and firmware-specific drivers.

A specific driver subclasses ``GdsPushDriver``, sets ``service``, ``generic = False`` and ``supported_devices``, and
overrides only what its device does differently: the class attributes under "What a specific driver may change" and
the small ``read_*``/``after_apply_changes``/``csr_subject`` methods. The simulated PLC's driver,
``certlm_opcua_simulator.driver`` (distribution ``certlm-opcua-simulator``), is an example.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import replace
from typing import Any, ClassVar

from asyncua import ua
from asyncua.client.ua_client import UaClientState
from cryptography import x509

from certlm import (
    CertificateReading,
    DeviceDescription,
    DeviceDriver,
    DeviceFailure,
    DeviceIdentity,
    DeviceIdentityChanged,
    DeviceReading,
    DeviceTarget,
    DeviceTimeouts,
    FirmwareInfo,
    PkiMaterial,
    PushOutcome,
    PushRequest,
    TrustList,
    UnsupportedOperation,
)
from certlm_gds_push import identity
from certlm_gds_push.connection import (
    DEFAULT_OPC_TCP_PORT,
    Announced,
    DeviceError,
    DeviceSession,
    ServerCheck,
    SessionSecurity,
    certificate_name,
    endpoints_of,
    explain,
    failure,
    found_nodes,
    open_session,
    remembered_endpoints,
    server_endpoints,
    server_listens,
    status_name,
    usable_endpoints,
)
from certlm_gds_push.push_flow import known_device_check, once_back, run_push
from certlm_gds_push.rejected_list import get_rejected_list, release_rejected
from certlm_gds_push.server_configuration import (
    RSA_SHA256_APPLICATION_CERTIFICATE_TYPE,
    ServerConfiguration,
    part12_subject,
    type_name,
)
from certlm_gds_push.trust_list import TrustListFile, check_trust_list, encoded_size, to_data_type

DI_NAMESPACE = "http://opcfoundation.org/UA/DI/"
# The DI nameplate and identification properties read_plc_info reports for each device of a DeviceSet.
DI_PROPERTIES = (
    "Manufacturer",
    "ManufacturerUri",
    "Model",
    "ProductCode",
    "SerialNumber",
    "HardwareRevision",
    "SoftwareRevision",
    "DeviceRevision",
    "RevisionCounter",
    "DeviceManual",
    "DeviceClass",
    "ProductInstanceUri",
    "AssetId",
    "ComponentName",
)
# The endpoints a device announced to ``read_certificate``, by URL, in the task (one device's monitor visit) that
# read them: the ``read_device`` that follows in the same visit opens its session on them rather than asking the
# device for them again. Taken once, so no later session of the task relies on them.
_announced: ContextVar[tuple[str, Announced] | None] = ContextVar("certlm_gds_announced_endpoints", default=None)
_UNREAD = object()  # a value not read yet
_BUILD_INFO = {
    "manufacturer": ua.ObjectIds.Server_ServerStatus_BuildInfo_ManufacturerName,
    "product": ua.ObjectIds.Server_ServerStatus_BuildInfo_ProductName,
    "software_version": ua.ObjectIds.Server_ServerStatus_BuildInfo_SoftwareVersion,
    "build_number": ua.ObjectIds.Server_ServerStatus_BuildInfo_BuildNumber,
}


class GdsPushDriver(DeviceDriver):
    """Any OPC UA server with Part 12 push management: ServerConfiguration and DefaultApplicationGroup's TrustList.

    Sessions go to the strongest endpoint the entry's security masks allow (see ``connection``); push management
    requires SignAndEncrypt. Failures of the read operations raise ``DeviceError`` (502) naming the OPC UA status;
    ``push`` raises ``PushFailed`` with its steps.
    """

    service = "gds-push-generic"
    protocol = "gds"
    extra_tables = ("opc",)
    url_scheme = "opc.tcp"
    default_port = DEFAULT_OPC_TCP_PORT
    generic = True

    # What a specific driver may change.
    certificate_types: ClassVar[tuple[ua.NodeId, ...]] = (RSA_SHA256_APPLICATION_CERTIFICATE_TYPE,)
    """Certificate types this driver enrolls in DefaultApplicationGroup, preferred first. The first one the group
    lists in its CertificateTypes is used; a group that lists none gets the first."""
    device_makes_csr: ClassVar[bool] = True
    """False for devices that cannot make a key pair: certlm makes an RSA 2048 key and sends it with the
    certificate. Devices answering CreateSigningRequest with BadNotSupported/BadNotImplemented/BadMethodInvalid are
    handled that way without this."""
    private_key_formats: ClassVar[tuple[str, ...]] = ("PEM", "PFX")
    """Formats for a key certlm made, preferred first; the first the device lists in SupportedPrivateKeyFormats is
    used. PEM is PKCS#8, PFX a PKCS#12 without password."""
    max_trust_list_size: ClassVar[int | None] = None
    """The device's real trust list limit in bytes, for firmware whose MaxTrustListSize is missing or wrong; None
    trusts MaxTrustListSize (0 there means unlimited)."""
    apply_settle_s: ClassVar[float] = 0.0
    """Seconds the device needs after ApplyChanges before it answers with the new certificate. Verification retries
    until the operation time-out anyway; a device that drops connections half-way through a restart needs this.
    After a trust list's ApplyChanges the session waits up to twice this for the device to drop it (``_reopened``)."""
    subject_separator: ClassVar[str] = "/"
    """Separator of CreateSigningRequest's subjectName (Part 12: ``/``), for firmware that reads another one;
    override ``csr_subject`` when a device wants the subject in yet another form."""

    @property
    def timeouts(self) -> DeviceTimeouts:
        return self.services.device_timeouts

    async def client_identity(self) -> identity.ClientIdentity:
        """certlm's client application certificate and key, from the host's database (needs the app context)."""
        return await identity.client_identity(self.services)

    @asynccontextmanager
    async def session(
        self,
        target: DeviceTarget,
        security: SessionSecurity = SessionSecurity.ANY,
        check_server: ServerCheck | None = None,
        announced: Announced | None = None,
    ) -> AsyncIterator[DeviceSession]:
        """A session with the device as certlm's client application and the entry's user. A device that rejects
        certlm's client certificate has certlm read its identity again at the next session, not only once the
        identity's refresh interval has passed: another instance may have renewed it (a campaign moving certlm to a
        new issuer), and the device trusts only the new one."""
        identity_now = await self.client_identity()
        async with open_session(
            target,
            identity_now,
            self.timeouts,
            security,
            check_server,
            on_client_rejected=lambda: identity.forget_client_identity(self.services),
            announced=announced,
            known=found_nodes(self.services),
            remembered=remembered_endpoints(self.services),
        ) as session:
            yield session

    @asynccontextmanager
    async def _reading(
        self,
        target: DeviceTarget,
        action: str,
        security: SessionSecurity = SessionSecurity.ANY,
        announced: Announced | None = None,
    ) -> AsyncIterator[DeviceSession]:
        # A read with the entry's credentials goes only to the device certlm pinned.
        pinned = known_device_check(
            PushRequest(pinned_certificate=target.pinned_certificate, trust_on_first_use=not target.pinned_certificate)
        )
        try:
            async with self.session(target, security, pinned, announced) as session:
                yield session
        except Exception as error:
            raise failure(action, error) from error

    # The DeviceDriver operations.

    async def describe(self, target: DeviceTarget) -> DeviceDescription:
        async with self._reading(target, "identifying the device") as session:
            return await self.read_description(session)

    async def read_firmware(self, target: DeviceTarget) -> FirmwareInfo:
        async with self._reading(target, "reading the firmware version") as session:
            build_info = await self.read_build_info(session)
        return FirmwareInfo(firmware_version=build_info["software_version"], device_name=build_info["product"])

    async def read_status(self, target: DeviceTarget) -> str:
        """ServerStatus.State by name (``Running``), followed by the operating state where the driver knows it."""
        async with self._reading(target, "reading the device status") as session:
            return await self._status(session)

    async def _status(self, session: DeviceSession, state: Any = _UNREAD) -> str:
        """``read_status``'s text; ``state`` is ServerStatus.State when the caller read it already."""
        if state is _UNREAD:
            (state,) = await session.read_values([ua.NodeId(ua.ObjectIds.Server_ServerStatus_State)])
        operating_state = await self.read_operating_state(session)
        status = ua.ServerState(state).name if state in set(ua.ServerState) else f"Unknown ({state})"
        return f"{status}, {operating_state}" if operating_state else status

    async def read_plc_info(self, target: DeviceTarget) -> dict[str, Any]:
        async with self._reading(target, "reading PLC information") as session:
            return await self.read_plc_details(session)

    async def read_certificate(self, target: DeviceTarget, *, secure_session: bool) -> CertificateReading:
        """Without ``secure_session`` the certificate announced by the strongest allowed endpoint (GetEndpoints,
        policy and mode 0); with it, the one the device presents on a Sign or SignAndEncrypt session."""
        if secure_session:
            async with self._reading(target, "reading the device certificate", SessionSecurity.SIGNED) as session:
                return CertificateReading(session.server_certificate, session.security_policy, session.security_mode)
        try:
            # Made ``Endpoint``s once: the session of ``read_device`` uses the certificates parsed here.
            announced = endpoints_of(await server_endpoints(target.url, self.timeouts))
            _announced.set((target.url, announced))
            endpoints = usable_endpoints(announced, target, SessionSecurity.ANY)
        except Exception as error:
            raise failure("reading the device certificate", error) from error
        certificate = next((e.certificate for e in endpoints if e.certificate is not None), None)
        if certificate is None:
            raise DeviceError("the device announces no certificate in its endpoints", "BadCertificateInvalid")
        return CertificateReading(certificate, 0, 0)

    async def read_trust_list(self, target: DeviceTarget, mask: int) -> TrustList:
        """DefaultApplicationGroup's trust list (OpenWithMasks, Read, Close), the lists in ``mask``."""
        async with self._reading(target, "reading the trust list", SessionSecurity.SIGNED) as session:
            return await (await _trust_list_file(session)).read_lists(mask)

    async def write_trust_list(self, target: DeviceTarget, trust_list: TrustList) -> TrustList | None:
        """Make ``trust_list`` DefaultApplicationGroup's whole trust list, on a SignAndEncrypt session: Open (Write,
        EraseExisting), Write, CloseAndUpdate, and ApplyChanges when CloseAndUpdate answers that the device needs it
        (one that answers False took the list into use at once). A failure before the list is in use cancels it
        (CancelChanges; closing the session does as well), so the old list stays in force. The list the device holds
        then is read back (``_written``); None when the device does not let it be read
        (``trust_list.READ_REFUSED_STATUSES``).

        Refused with ``DeviceError`` before anything is sent: a list that would lock certlm out
        (``refuse_lockout``) or holds what is not DER; after the device described itself, one over its limit
        (``trust_list_limit``)."""
        client = await self.client_identity()
        refuse_lockout(trust_list, client)
        refuse_malformed(trust_list)
        async with self._reading(target, "writing the trust list", SessionSecurity.ENCRYPTED) as session:
            configuration, trust_file = await ServerConfiguration.locate_with_trust_list(session)
            read_back = await self._written(target, session, configuration, trust_file, trust_list)
        return await read_back()

    async def change_trust_list(
        self, target: DeviceTarget, compose: Callable[[TrustList], TrustList | None]
    ) -> TrustList | None:
        """Read, compose and write DefaultApplicationGroup's trust list in one SignAndEncrypt session, refused as
        ``write_trust_list`` refuses before anything is written, and read back (``_written``)."""
        client = await self.client_identity()
        async with self._reading(target, "changing the trust list", SessionSecurity.ENCRYPTED) as session:
            configuration, trust_file = await ServerConfiguration.locate_with_trust_list(session)
            current = await trust_file.read_lists(TrustList.ALL)
            trust_list = compose(current)
            if trust_list is None:
                return current
            refuse_lockout(trust_list, client)
            refuse_malformed(trust_list)
            read_back = await self._written(target, session, configuration, trust_file, trust_list, current)
        return await read_back()

    async def _written(
        self,
        target: DeviceTarget,
        session: DeviceSession,
        configuration: ServerConfiguration,
        trust_file: TrustListFile,
        trust_list: TrustList,
        held: TrustList | None = None,
    ) -> Callable[[], Awaitable[TrustList | None]]:
        """Write ``trust_list`` in ``session`` (``_write_in``) and read it back in the same session: a device that took
        it into use at CloseAndUpdate, or answered ApplyChanges, holds it now. A device that applied changes drops
        every channel a moment later and listens again. Where the driver says within how long (``apply_settle_s``),
        the session is kept until it drops, and the device tried until it accepts a connection again, so the
        operation leaves a device that listens (``_reopened``); a device that keeps the channel did not restart.
        Where it does not, the list is read back in new sessions (``_read_back``). Returns what gives the list read
        back once the session is closed: the list, or a read in a new session when the read here failed after
        ApplyChanges, cut off by the drop (on the endpoints this session was opened on: a trust list does not change
        the device's certificate). ``held`` as for ``_write_in``."""
        applied_changes = await self._write_in(session, configuration, trust_file, trust_list, held)
        if applied_changes and not self.apply_settle_s:
            # A driver that does not say when its device restarts cannot wait for the drop (node-opcua drops every
            # channel about 2 s after ApplyChanges): the list is read back in new sessions, tried until one answers.
            return lambda: self._read_back(target, trust_file)
        try:
            after = await trust_file.read_if_allowed(TrustList.ALL)
        except Exception:
            if not applied_changes:
                raise
            # Cut off by the device's restart (or refused in a way a new session reports with what was applied).
            announced = session.announced
            return lambda: self._read_back(target, trust_file, announced)
        if applied_changes:
            await self._reopened(target, session)

        async def read_back() -> TrustList | None:
            return after

        return read_back

    async def _reopened(self, target: DeviceTarget, session: DeviceSession) -> None:
        """After ApplyChanges: until the device dropped ``session``'s channel, within twice ``apply_settle_s`` (the
        time the device needs, doubled for a loaded one), and then until it accepts connections again
        (``server_listens``). A fixed pause would cost every device the whole settle time
        whenever it restarts sooner, and a device step holds one of a campaign's concurrent places all along."""
        async with session.client.uaclient.subscribe_state() as states:
            try:
                await states.wait_for_state(UaClientState.DISCONNECTED, 2 * self.apply_settle_s)
            except TimeoutError:
                return  # the device keeps its channels: it took the changes in without a restart
        try:
            await once_back(self.timeouts, lambda: server_listens(target.url, self.timeouts))
        except Exception as error:
            raise DeviceError(
                f"the device took the new trust list into use, but did not listen again: {explain(error)}",
                status_name(error),
            ) from error

    async def _write_in(
        self,
        session: DeviceSession,
        configuration: ServerConfiguration,
        trust_file: TrustListFile,
        trust_list: TrustList,
        held: TrustList | None = None,
    ) -> bool:
        """Write ``trust_list`` in ``session`` once it fits the device's limit, and take it into use; whether that
        took ApplyChanges (after which the device drops every channel). ``held``: the whole list the device holds,
        read in this session; a list no larger fits whatever the limit (a campaign's retire takes an issuer out),
        so the limit is not read for it, and a list that trusts nothing the device does not trust already releases
        no rejected certificate (below), so the device is not asked for them."""
        if held is None or encoded_size(trust_list, TrustList.ALL) > encoded_size(held, TrustList.ALL):
            check_trust_list(trust_list, await self._trust_list_limit_in(session, configuration), TrustList.ALL)
        # node-opcua refuses a certificate in its rejected/ folder whatever the trusted list holds: released first,
        # when the list trusts what the device did not (a certificate it trusted already was refused before this write
        # as after it, and is no business of this one).
        if held is None or set(trust_list.trusted_certificates) - set(held.trusted_certificates):
            await release_rejected(session, configuration.node_id, trust_file.node_id, trust_list.trusted_certificates)
        applied_changes = await _take_into_use(configuration, trust_file, trust_list)
        if applied_changes:
            await self.after_apply_changes(session)
        return applied_changes

    async def _trust_list_limit_in(self, session: DeviceSession, configuration: ServerConfiguration) -> int:
        """``trust_list_limit`` for the device of ``session``. Unless a driver overrides ``trust_list_limit`` (which
        may look at any part of the description), only MaxTrustListSize is read, not the whole description."""
        if type(self).trust_list_limit is not GdsPushDriver.trust_list_limit:
            return self.trust_list_limit(await self.read_description(session))
        if self.max_trust_list_size is not None:
            return self.max_trust_list_size
        (max_size,) = await session.read_values([configuration.nodes["MaxTrustListSize"]])
        return int(max_size or 0)

    async def _read_back(
        self, target: DeviceTarget, written: TrustListFile, announced: Announced | None = None
    ) -> TrustList | None:
        """The whole trust list after a write, None when the device does not let it be read; retried in new
        sessions within the operation time-out, since a device that applied changes drops every channel a moment
        later. The TrustList's nodes are those the write found (``written``): the device's address space is the
        same after it applied the list. The first session is opened on ``announced`` (the endpoints of the write's
        session) when given; a try after a failed one asks the device for its endpoints again, as it may have
        restarted them meanwhile."""
        endpoints = [announced]

        async def read() -> TrustList | None:
            first, endpoints[0] = endpoints[0], None
            async with self._reading(target, "reading the trust list back", SessionSecurity.SIGNED, first) as session:
                return await replace(written, session=session).read_if_allowed(TrustList.ALL)

        try:
            return await once_back(self.timeouts, read)
        except DeviceIdentityChanged:
            raise
        except DeviceFailure as error:
            raise DeviceError(
                f"the device took the new trust list into use, but {error.message}", error.device_status
            ) from error

    async def read_device(self, target: DeviceTarget) -> DeviceReading:
        """Trust list, firmware, status and the rejected client certificates (where the device lists them to
        certlm) in one signed session: what the monitor reads each scan, right after ``read_certificate``, whose
        endpoints it opens the session on."""
        announced, url = _announced.get(), target.url
        _announced.set(None)
        endpoints = announced[1] if announced is not None and announced[0] == url else None
        async with self._reading(target, "reading the device", SessionSecurity.SIGNED, endpoints) as session:
            # Nothing found on the device yet: its nodes are read where Part 12 puts them, found only if not there.
            configuration, trust_file = await ServerConfiguration.locate_with_trust_list(session, assume_standard=True)
            trust_list = await trust_file.read_lists(TrustList.ALL)
            build_info, state = await self._build_info_and_state(session)
            status = await self._status(session, state)
            try:
                rejected = await get_rejected_list(session, configuration.node_id)
            except UnsupportedOperation:
                rejected = None
        firmware = FirmwareInfo(firmware_version=build_info["software_version"], device_name=build_info["product"])
        return DeviceReading(trust_list=trust_list, firmware=firmware, status=status, rejected_certificates=rejected)

    async def read_rejected_list(self, target: DeviceTarget) -> list[x509.Certificate]:
        """ServerConfiguration.GetRejectedList on a SignAndEncrypt session as the entry's user (``rejected_list``)."""
        async with self._reading(target, "reading the rejected list", SessionSecurity.ENCRYPTED) as session:
            return await get_rejected_list(session, (await ServerConfiguration.locate(session)).node_id)

    async def push(self, target: DeviceTarget, request: PushRequest, pki: PkiMaterial) -> PushOutcome:
        """The Part 12 push flow (``push_flow``) in one session; at first contact (``request.identify``) the
        description it reads selects the driver, and a ``GdsPushDriver`` selected goes on in that session."""
        return await run_push(self, target, request, pki)

    async def _build_info_and_state(self, session: DeviceSession) -> tuple[dict[str, str], Any]:
        """``read_build_info`` and ServerStatus.State, in one Read unless a driver reads its build info otherwise."""
        state_node = ua.NodeId(ua.ObjectIds.Server_ServerStatus_State)
        if type(self).read_build_info is not GdsPushDriver.read_build_info:
            return await self.read_build_info(session), (await session.read_values([state_node]))[0]
        *values, state = await session.read_values([*(ua.NodeId(node) for node in _BUILD_INFO.values()), state_node])
        return _build_info(values), state

    # Reading the device, in an open session. A specific driver overrides what its device offers differently.

    async def read_build_info(self, session: DeviceSession) -> dict[str, str]:
        """ServerStatus.BuildInfo: manufacturer, product, software_version, build_number."""
        return _build_info(await session.read_values([ua.NodeId(node) for node in _BUILD_INFO.values()]))

    async def read_description(self, session: DeviceSession) -> DeviceDescription:
        """Identity from BuildInfo; capabilities from ServerConfiguration (see ``ServerConfiguration.capabilities``)
        plus BuildNumber, the ApplicationUri and the endpoint used."""
        configuration = await ServerConfiguration.locate(session)
        # BuildInfo goes in the Read of the capabilities unless a driver reads it otherwise: one round trip less.
        own_build_info = type(self).read_build_info is GdsPushDriver.read_build_info
        build_info_nodes = [ua.NodeId(node) for node in _BUILD_INFO.values()] if own_build_info else []
        device_capabilities, build_info_values = await configuration.capabilities(build_info_nodes)
        build_info = _build_info(build_info_values) if own_build_info else await self.read_build_info(session)
        capabilities = {
            "build_number": build_info["build_number"],
            "application_uri": session.endpoint.description.Server.ApplicationUri,
            "endpoint": session.endpoint.name,
            **device_capabilities,
        }
        return DeviceDescription(
            DeviceIdentity(build_info["manufacturer"], build_info["product"], build_info["software_version"]),
            capabilities,
            certificate=session.server_certificate,
        )

    async def read_operating_state(self, session: DeviceSession) -> str | None:
        """The operating state ``read_status`` appends (``operating mode run``); None where unknown."""
        return None

    async def read_plc_details(self, session: DeviceSession) -> dict[str, Any]:
        """What OPC UA DI offers: each device of the DeviceSet with its nameplate properties."""
        namespaces = await session.request(session.client.get_namespace_array())
        if DI_NAMESPACE not in namespaces:
            return {"devices": [], "explanation": f"the server has no OPC UA DI DeviceSet ({DI_NAMESPACE} unknown)"}
        di = namespaces.index(DI_NAMESPACE)
        (device_set,) = await session.translate(ua.NodeId(ua.ObjectIds.ObjectsFolder), [f"{di}:DeviceSet"])
        if device_set is None:
            return {"devices": [], "explanation": "the server has no OPC UA DI DeviceSet object"}
        devices = []
        for device in await session.children(device_set):
            if device.NodeClass != ua.NodeClass.Object:
                continue
            properties = [
                child for child in await session.children(device.NodeId) if child.BrowseName.Name in DI_PROPERTIES
            ]
            values = await session.read_values([child.NodeId for child in properties])
            devices.append(
                {
                    "name": device.BrowseName.Name,
                    "node_id": device.NodeId.to_string(),
                    **{
                        child.BrowseName.Name: _json_value(value)
                        for child, value in zip(properties, values, strict=True)
                        if value is not None
                    },
                }
            )
        return {"devices": devices}

    # Push quirks.

    def certificate_type(self, description: DeviceDescription) -> ua.NodeId:
        """The certificate type to enroll, from ``certificate_types`` and what DefaultApplicationGroup lists."""
        groups = description.capabilities.get("certificate_groups", [])
        offered = next((g["certificate_types"] for g in groups if g["name"] == "DefaultApplicationGroup"), [])
        for certificate_type in self.certificate_types:
            if not offered or type_name(certificate_type) in offered:
                return certificate_type
        raise DeviceError(
            f"DefaultApplicationGroup accepts {', '.join(offered)}; {self.service} enrolls only "
            f"{', '.join(type_name(t) for t in self.certificate_types)}",
            "BadNotSupported",
        )

    def private_key_format(self, description: DeviceDescription) -> str:
        """The format for a key certlm made: the first of ``private_key_formats`` the device supports."""
        supported = description.capabilities.get("supported_private_key_formats", [])
        for key_format in self.private_key_formats:
            if key_format in supported:
                return key_format
        raise DeviceError(
            f"the device cannot make a CSR and accepts no private key format certlm can send "
            f"(it supports {supported or 'none'}, certlm sends {', '.join(self.private_key_formats)})",
            "BadNotSupported",
        )

    def trust_list_limit(self, description: DeviceDescription) -> int:
        """The trust list size limit in bytes, 0 for none."""
        if self.max_trust_list_size is not None:
            return self.max_trust_list_size
        return int(description.capabilities.get("max_trust_list_size") or 0)

    def csr_subject(self, subject: str | None) -> str:
        """The REST ``subject`` (RFC 4514) as CreateSigningRequest's subjectName; ``""`` keeps the device's subject."""
        return part12_subject(subject, self.subject_separator)

    async def after_apply_changes(self, session: DeviceSession) -> None:
        """Called after a successful ApplyChanges, in the same session: a device that needs a restart or another
        vendor method to take the new certificate into use calls it here."""


def _build_info(values: list[Any]) -> dict[str, str]:
    return {key: str(value or "") for key, value in zip(_BUILD_INFO, values, strict=True)}


def refuse_lockout(trust_list: TrustList, client: identity.ClientIdentity) -> None:
    """Refuse a trust list whose trusted certificates hold neither certlm's client certificate nor a CA of its chain:
    from the moment the device took it into use it would refuse certlm, and nothing could repair that remotely."""
    if client.trusted_by(trust_list.trusted_certificates):
        return
    accepted = " or ".join(
        [f"certlm's client certificate {certificate_name(client.certificate)}"]
        + [f"its CA {certificate_name(ca)}" for ca in client.chain]
    )
    raise DeviceError(
        f"the trust list would lock certlm out: its trusted certificates must hold {accepted}, or the device refuses "
        "certlm from then on. Nothing was sent to the device",
        "BadRequestNotAllowed",
    )


def refuse_malformed(trust_list: TrustList) -> None:
    """Refuse a trust list with an entry that is not a DER certificate or CRL, as its list says, before a device that
    stores what it is given (node-opcua writes each entry to a file) keeps it."""
    for name, load in (
        ("trusted_certificates", x509.load_der_x509_certificate),
        ("trusted_crls", x509.load_der_x509_crl),
        ("issuer_certificates", x509.load_der_x509_certificate),
        ("issuer_crls", x509.load_der_x509_crl),
    ):
        for index, entry in enumerate(getattr(trust_list, name)):
            try:
                load(entry)
            except ValueError:
                kind = "CRL" if name.endswith("crls") else "certificate"
                raise DeviceError(
                    f"{name}[{index}] is not a DER {kind}: nothing was sent to the device", "BadCertificateInvalid"
                ) from None


async def _trust_list_file(session: DeviceSession) -> TrustListFile:
    """DefaultApplicationGroup's TrustList, where the device's ServerConfiguration has it."""
    return (await ServerConfiguration.locate_with_trust_list(session))[1]


async def _take_into_use(configuration: ServerConfiguration, trust_file: TrustListFile, trust_list: TrustList) -> bool:
    """Write the whole ``trust_list`` and ApplyChanges when the device needs it; whether it did. A failure cancels
    what is pending, which leaves the old list in force unless the device took the new one already."""
    try:
        if not await trust_file.write(to_data_type(trust_list, TrustList.ALL)):
            return False
        await configuration.apply_changes()
    except Exception:
        await configuration.cancel_changes()
        raise
    return True


def _json_value(value: Any) -> Any:
    """An OPC UA value as JSON data."""
    if isinstance(value, ua.LocalizedText):
        return value.Text
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [_json_value(item) for item in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)
