"""One simulated OPC UA device on asyncua's ``Server``: identity, users, nodes, endpoints and their restarts."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from asyncua import Server, ua
from asyncua.crypto.permission_rules import PermissionRuleset, User, UserRole
from asyncua.server.binary_server_asyncio import BinaryServer
from asyncua.server.internal_server import InternalServer
from asyncua.server.internal_session import InternalSession
from asyncua.server.user_managers import UserManager
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import rsa

from .address_space import CopyOnReadNodes, standard_nodes
from .config import SimulatorConfig
from .pki import TrustList, create_self_signed_certificate, der_of, load_certificate_der, thumbprint
from .push_management import Caller, PushManagement, current_caller
from .store import DeviceState, StateFolder

_logger = logging.getLogger(__name__)

DI_NAMESPACE = "http://opcfoundation.org/UA/DI/"
SIMULATOR_NAMESPACE = "urn:certlm:simulator"
DEVICE_SET_ID = 5001
"""The NodeId (in the DI namespace) OPC 10000-100 gives the DeviceSet object."""
_BUILD_DATE = datetime(2024, 1, 1, tzinfo=UTC)  # a firmware image's build date does not change


@dataclass
class DeviceUser(User):
    """A logged-in user; ``security_admin`` may call the push certificate management methods."""

    security_admin: bool = False


class _UserManager(UserManager):
    def __init__(self, users: Mapping[str, tuple[str, str]], admin_certificates: set[bytes]) -> None:
        self._users = users
        self._admin_certificates = admin_certificates

    def get_user(
        self,
        iserver: InternalServer,
        username: str | None = None,
        password: str | None = None,
        certificate: Any = None,
    ) -> User | None:
        # None refuses the login with BadUserAccessDenied. Every login gets its own user object, whose
        # identity then stands for the session (see push_management.Caller).
        if username is not None:
            entry = self._users.get(username)
            if entry is None or not hmac.compare_digest(entry[0].encode(), (password or "").encode()):
                return None
            return DeviceUser(role=UserRole.User, name=username, security_admin=entry[1] == "admin")
        if certificate is not None:
            if certificate not in self._admin_certificates:
                return None
            return DeviceUser(role=UserRole.User, name=f"certificate {thumbprint(certificate)}", security_admin=True)
        return DeviceUser(role=UserRole.Anonymous)


class _DeviceSession(InternalSession):
    iserver: _DeviceInternalServer

    async def get_endpoints(
        self, params: ua.GetEndpointsParameters | None = None, sockname: tuple[str, int] | None = None
    ) -> list[ua.EndpointDescription]:
        # CreateSession's answer lists the endpoints as well; only a GetEndpoints request counts as one.
        return await InternalServer.get_endpoints(self.iserver, params, sockname)

    def activate_session(self, params: ua.ActivateSessionParameters, peer_certificate: bytes | None) -> Any:
        # asyncua hands the channel's client application certificate to the user manager for anonymous
        # logins too; only an X.509 identity token (whose certificate asyncua puts in instead) is a user.
        return super().activate_session(params, None)

    async def close_session(self, delete_subs: bool = True) -> None:
        await super().close_session(delete_subs)
        self.iserver.session_closed(self.user)


class _DeviceInternalServer(InternalServer):
    """asyncua's internal server, telling the device when a session closes and counting the sessions, endpoint lists
    and requests in sessions clients ask for (what a client costs a device)."""

    def __init__(self, user_manager: UserManager) -> None:
        super().__init__(user_manager=user_manager)
        self.session_closed: Callable[[Any], None] = lambda user: None
        self.sessions_created = 0
        self.endpoint_requests = 0
        self.requests_by_service: Counter[str] = Counter()  # counted by ChannelRuleset, which sees each request

    async def get_endpoints(
        self, params: ua.GetEndpointsParameters | None = None, sockname: tuple[str, int] | None = None
    ) -> list[ua.EndpointDescription]:
        self.endpoint_requests += 1
        return await super().get_endpoints(params, sockname)

    async def load_standard_address_space(self, shelf_file: Path | None = None) -> None:
        # The nodes are shared with every device of the process (see address_space); _nodes is where
        # asyncua's AddressSpace keeps them, as its own shelf loading does.
        self.aspace._nodes = CopyOnReadNodes(await asyncio.to_thread(standard_nodes))

    def create_session(self, name: str, user: User | None = None, external: bool = False) -> InternalSession:
        if external:  # the server's own internal session is no client's
            self.sessions_created += 1
        return _DeviceSession(
            self,
            self.aspace,
            self.subscription_service,
            name,
            user=user or User(role=UserRole.Anonymous),
            external=external,
        )


# A request's type (``ReadRequest_Encoding_DefaultBinary``) by its service's name (``Read``).
_SERVICE_NAMES = {
    identifier: name.removesuffix("Request_Encoding_DefaultBinary")
    for identifier, name in ua.ObjectIdNames.items()
    if name.endswith("Request_Encoding_DefaultBinary")
}


class ChannelRuleset(PermissionRuleset):
    """asyncua's per-request permission hook, one per endpoint: records who calls over which security mode, and
    counts the request for the device by service (``_DeviceInternalServer.requests_by_service``)."""

    def __init__(self, mode: ua.MessageSecurityMode, iserver: _DeviceInternalServer) -> None:
        self.mode = mode
        self.iserver = iserver

    def check_validity(self, user: User, action_type_id: ua.NodeId, body: Any) -> bool:
        self.iserver.requests_by_service[_SERVICE_NAMES.get(action_type_id.Identifier, str(action_type_id))] += 1
        # asyncua runs this in the connection's task just before it processes the request, so the
        # method callbacks of that request see the caller (push_management.current_caller).
        current_caller.set(Caller(user, self.mode))
        return True


class SimulatedDevice:
    """An OPC UA server behaving like a PLC with Part 12 push certificate management.

    Its state (certificate, key, trust list, rejected certificates) lives in ``config.state_dir/<port>``.
    """

    def __init__(self, config: SimulatorConfig) -> None:
        self.config = config
        self._server: Server | None = None
        self._state: DeviceState | None = None
        self._push: PushManagement | None = None
        self._endpoint_task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"opc.tcp://{self.config.host}:{self.config.port}"

    @property
    def application_uri(self) -> str:
        return self.config.effective_application_uri

    @property
    def certificate(self) -> x509.Certificate:
        """The certificate applied last, which the endpoints present once they reopened after applying it."""
        return self._started_state().certificate

    @property
    def trust_list(self) -> TrustList:
        return self._started_state().trust_list

    @property
    def rejected(self) -> list[bytes]:
        """Client certificates (DER) refused so far, oldest first, as GetRejectedList returns them."""
        return list(self._started_state().rejected)

    @property
    def sessions_created(self) -> int:
        """Sessions clients created since the device started (CreateSession requests answered)."""
        return self._started_iserver().sessions_created

    @property
    def trust_list_changes(self) -> int:
        """Trust lists taken into use since the device started (a write's CloseAndUpdate or ApplyChanges, an
        AddCertificate or RemoveCertificate)."""
        assert self._push is not None, "the device has not been started"
        return self._push.trust_list_changes

    @property
    def endpoint_requests(self) -> int:
        """GetEndpoints requests answered since the device started."""
        return self._started_iserver().endpoint_requests

    @property
    def session_requests(self) -> int:
        """Requests answered in sessions since the device started: every service call but those that create,
        activate and close a session (each Read, Browse, TranslateBrowsePathsToNodeIds, Call, ...)."""
        return self._started_iserver().requests_by_service.total()

    @property
    def requests_by_service(self) -> dict[str, int]:
        """``session_requests`` by service (``Read``, ``Call``, ``TranslateBrowsePathsToNodeIds``, ...)."""
        return dict(self._started_iserver().requests_by_service)

    def _started_iserver(self) -> _DeviceInternalServer:
        if self._server is None:
            raise RuntimeError("the device has not been started")
        assert isinstance(self._server.iserver, _DeviceInternalServer)
        return self._server.iserver

    @property
    def installed_certificates(self) -> list[str]:
        """The serials (hex) of the certificates pushed to the device and installed, oldest first."""
        return StateFolder(self.config.device_state_dir).installations()

    @property
    def listening(self) -> bool:
        return self._server is not None and self._server.bserver is not None

    def _started_state(self) -> DeviceState:
        if self._state is None:
            raise RuntimeError("the device has not been started")
        return self._state

    async def start(self) -> None:
        config = self.config
        store = StateFolder(config.device_state_dir)
        state = await asyncio.to_thread(store.load)
        if state is None:
            state = await asyncio.to_thread(self._first_state)
            await asyncio.to_thread(store.save, state)
        self._state = state
        admin_certificates = {load_certificate_der(source) for source in config.admin_user_certificates}
        iserver = _DeviceInternalServer(_UserManager(config.users, admin_certificates))
        server = Server(iserver=iserver)
        server.manufacturer_name = config.manufacturer
        server.product_uri = f"{SIMULATOR_NAMESPACE}:{config.product_slug}"
        server.application_type = ua.ApplicationType.Server
        server.set_server_name(config.effective_application_name)
        server.set_endpoint(self.url)
        server.set_security_policy([ua.SecurityPolicyType[name] for name in config.security_policies])
        await server.init()
        await server.set_application_uri(self.application_uri)
        await server.set_build_info(
            server.product_uri, config.manufacturer, config.product, config.firmware, config.firmware, _BUILD_DATE
        )
        self._server = server
        push = PushManagement(
            server,
            state,
            store,
            config,
            on_applied=self._present_new_state,
            on_drop=self._go_down,
            on_disconnect=self._disconnect,
        )
        self._push = push
        iserver.session_closed = push.session_closed
        server.set_certificate_validator(push.validate_client_certificate)
        await push.install()
        await self._add_device_nodes(server)
        await server.iserver.start()
        await self._listen()
        _logger.info("%s listening as %s", self.url, self.application_uri)

    def _first_state(self) -> DeviceState:
        config = self.config
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        certificate = create_self_signed_certificate(
            key,
            application_uri=self.application_uri,
            application_name=config.effective_application_name,
            organization=config.manufacturer,
            host=config.host,
            days=config.certificate_days,
        )
        trusted = tuple(dict.fromkeys(load_certificate_der(source) for source in config.trusted_client_certificates))
        return DeviceState(certificate, key, trust_list=TrustList(trusted_certificates=trusted))

    async def _add_device_nodes(self, server: Server) -> None:
        config = self.config
        di = await server.register_namespace(DI_NAMESPACE)
        simulator = await server.register_namespace(SIMULATOR_NAMESPACE)
        objects = server.nodes.objects
        device_set = await objects.add_object(ua.NodeId(DEVICE_SET_ID, di), ua.QualifiedName("DeviceSet", di))
        device_name = "".join(word.capitalize() if word.islower() else word for word in config.product.split())
        device = await device_set.add_object(simulator, device_name or "Device")
        for name, value in (
            ("Manufacturer", config.manufacturer),
            ("Model", config.product),
            ("SerialNumber", f"SIM-{config.port:05d}"),
            ("SoftwareRevision", config.firmware),
            ("HardwareRevision", "1.0"),
            ("DeviceRevision", "1.0"),
            ("ProductCode", config.product_slug.upper()),
        ):
            # The DI properties have DI browse names; new NodeIds are in the simulator's namespace.
            await device.add_property(
                ua.NodeId(NamespaceIndex=simulator), ua.QualifiedName(name, di), value, ua.VariantType.String
            )
        plc = await objects.add_object(simulator, "PLC")
        for name, value, variant_type in (
            ("OperatingMode", config.operating_mode, ua.VariantType.String),
            ("ProgramName", config.program_name, ua.VariantType.String),
            ("CycleTimeMs", 10.0, ua.VariantType.Double),
        ):
            await plc.add_variable(simulator, name, value, variant_type)

    async def _listen(self) -> None:
        """Open the endpoints with the current certificate, as asyncua's ``Server.start`` would."""
        server, state = self._server, self._state
        assert server is not None and state is not None
        server.iserver.certificate = state.certificate
        server.iserver.private_key = state.private_key
        # asyncua builds endpoints and SecurityPolicyFactory objects only in start(); rebuild them with the
        # new certificate (private asyncua API: there is no public way short of a new Server).
        server.iserver.endpoints.clear()
        server._policies = []
        await server._setup_server_nodes()
        for factory in server._policies:
            factory.permission_ruleset = ChannelRuleset(factory.mode, self._started_iserver())
        bserver = BinaryServer(server.iserver, self.config.host, self.config.port, server.limits)
        bserver.set_policies(server._policies)
        await bserver.start()
        server.bserver = bserver

    async def _close_endpoints(self) -> None:
        assert self._server is not None
        bserver, self._server.bserver = self._server.bserver, None
        if bserver is not None:
            # Shielded: a device stopped meanwhile must still let asyncua finish closing its connections.
            await asyncio.shield(bserver.stop())

    def _present_new_state(self) -> None:
        """After changes were applied (ApplyChanges, or a certificate applied at once): drop every channel and
        listen again, presenting the new certificate."""

        async def reopen() -> None:
            await asyncio.sleep(self.config.apply_delay_s)
            await self._close_endpoints()
            await self._listen()
            _logger.info("%s presents certificate %s", self.url, thumbprint(der_of(self.certificate)))

        self._replace_endpoint_task(reopen())

    def _disconnect(self, user: Any) -> None:
        """Injected failure (``drop_at``): close the TCP connections of ``user``'s session, as a network that drops
        them would; the device stays up and the client may connect again at once."""
        bserver = self._server.bserver if self._server is not None else None
        for protocol in list(bserver.clients if bserver is not None else ()):
            session = protocol.processor.session if protocol.processor is not None else None
            if session is not None and session.user is user and protocol.transport is not None:
                protocol.transport.abort()

    def _go_down(self) -> None:
        """Injected failure: the device dies mid-call (no answer), and comes back after ``down_s`` if given."""
        assert self._server is not None and self._push is not None
        self._push.discard_pending()
        bserver, self._server.bserver = self._server.bserver, None
        if bserver is None:
            return
        for transport in list(self._server.iserver.asyncio_transports):
            transport.abort()
        # Refuse new connections right now, before a client could reconnect (private asyncua attribute).
        if bserver._server is not None:
            bserver._server.close()

        async def stay_down() -> None:
            await asyncio.shield(bserver.stop())
            if self.config.down_s is not None:
                await asyncio.sleep(self.config.down_s)
                await self._listen()
                _logger.info("%s is back", self.url)

        self._replace_endpoint_task(stay_down())

    async def settle(self) -> None:
        """Wait until the endpoints are done reopening after applied changes or after a drop with ``down_s``."""
        while (task := self._endpoint_task) is not None and not task.done():
            await asyncio.wait([task])
        if task is not None and not task.cancelled():
            task.result()

    def _replace_endpoint_task(self, work: Awaitable[None]) -> None:
        if self._endpoint_task is not None:
            self._endpoint_task.cancel()
        self._endpoint_task = asyncio.ensure_future(work)

    async def stop(self) -> None:
        if self._endpoint_task is not None:
            self._endpoint_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._endpoint_task
            self._endpoint_task = None
        server, self._server = self._server, None
        if server is None:
            return
        # asyncua's stop() waits for its one-second clock tick to end; a device can just cancel it.
        clock, server.iserver.time_task = server.iserver.time_task, None
        if clock is not None:
            clock.cancel()
        await server.stop()

    async def __aenter__(self) -> SimulatedDevice:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


@asynccontextmanager
async def run_devices(config: SimulatorConfig, count: int = 1) -> AsyncIterator[list[SimulatedDevice]]:
    """``count`` devices on consecutive ports from ``config.port``, started concurrently, stopped at exit."""
    devices = [SimulatedDevice(replace(config, port=config.port + index)) for index in range(count)]
    try:
        results = await asyncio.gather(*(device.start() for device in devices), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        yield devices
    finally:
        await asyncio.gather(*(device.stop() for device in devices))
