"""Opening OPC UA sessions to a device: which endpoint within the entry's security masks, certlm's client application
and the device user, the check of the certificate the device presents, time-outs, and OPC UA status names for failures.

Security policy and mode bits are the spec's (``GET /gds/systeminfo``): policies 1 Basic128Rsa15, 2 Basic256,
4 Aes128Sha256RsaOaep, 8 Basic256Sha256, 16 Aes256Sha256RsaPss; modes 1 Sign, 2 SignAndEncrypt; 0 means none.
asyncua 2.1's client implements all five policies (Basic128Rsa15 and Basic256 are deprecated by OPC UA and asyncua
logs a warning when they are used).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Hashable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar
from urllib.parse import urlsplit

from asyncua import Client, ua
from asyncua.client.ua_client import StateSubscription, UaClientState
from asyncua.common.methods import call_method_full
from asyncua.crypto import security_policies, uacrypto
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.serialization import pkcs12

from certlm import (
    APIError,
    CsrRejected,
    DeviceFailure,
    DeviceTarget,
    DeviceTimeouts,
    UnsupportedOperation,
    UpstreamUnavailable,
    sha1_fingerprint,
    to_der,
)
from certlm_gds_push.identity import ClientIdentity
from certlm_gds_push.per_host import PerHost

log = logging.getLogger(__name__)


class _WithoutRequestBodies(logging.Filter):
    """asyncua logs every request it sends at DEBUG level, with the user's password (ActivateSession) and a private
    key certlm made (UpdateCertificate) in it; those records never reach a log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "Sending: %s"


logging.getLogger("asyncua.client.ua_client.UASocketProtocol").addFilter(_WithoutRequestBodies())

_T = TypeVar("_T")
SESSION_TIMEOUT_MS = 600_000
DEFAULT_OPC_TCP_PORT = 4840  # IANA's opc-ua-tcp, for a URL without a port

# Strongest first. The None policy has no bit: it is never "within" a policy mask (see ``Endpoint.allowed_by``).
POLICIES_BY_STRENGTH: tuple[tuple[type[security_policies.SecurityPolicy], int], ...] = (
    (security_policies.SecurityPolicyAes256Sha256RsaPss, 16),
    (security_policies.SecurityPolicyBasic256Sha256, 8),
    (security_policies.SecurityPolicyAes128Sha256RsaOaep, 4),
    (security_policies.SecurityPolicyBasic256, 2),
    (security_policies.SecurityPolicyBasic128Rsa15, 1),
)
POLICY_BITS: dict[str, int] = {policy.URI: bit for policy, bit in POLICIES_BY_STRENGTH}
MODE_BITS: dict[ua.MessageSecurityMode, int] = {
    ua.MessageSecurityMode.None_: 0,
    ua.MessageSecurityMode.Sign: 1,
    ua.MessageSecurityMode.SignAndEncrypt: 2,
}
_POLICY_RANKS = {policy: len(POLICIES_BY_STRENGTH) - rank for rank, (policy, _) in enumerate(POLICIES_BY_STRENGTH)}
_POLICY_CLASSES: dict[str, type[security_policies.SecurityPolicy]] = {
    policy.URI: policy for policy, _ in POLICIES_BY_STRENGTH
} | {security_policies.SecurityPolicyNone.URI: security_policies.SecurityPolicyNone}


class DeviceError(DeviceFailure):
    """A device operation that failed or that certlm refused; its ``device_status`` is the OPC UA status name
    (``BadUserAccessDenied``, ``BadTimeout``, ...) the push steps report."""


def status_name(error: BaseException) -> str:
    """The OPC UA status name that best describes ``error``. A PKI's answers get the statuses Part 12's
    certificate manager gives for them (a refused request is BadRequestNotAllowed)."""
    if isinstance(error, DeviceFailure):
        return error.device_status
    if isinstance(error, CsrRejected):
        return "BadRequestNotAllowed"
    if isinstance(error, UpstreamUnavailable):
        return "BadCommunicationError"
    if isinstance(error, UnsupportedOperation):
        return "BadNotSupported"
    if isinstance(error, APIError):
        return "BadConfigurationError"
    if isinstance(error, ua.UaStatusCodeError) and error.code is not None:
        return ua.StatusCode(error.code).name
    if isinstance(error, TimeoutError):
        return "BadTimeout"
    if isinstance(error, ConnectionRefusedError | socket.gaierror):
        return "BadNotConnected"
    if isinstance(error, OSError):  # ConnectionResetError, EOF, unreachable network
        return "BadCommunicationError"
    return "BadUnexpectedError"


def explain(error: BaseException) -> str:
    """``error`` in one line: an API error's message, else ``<status> (<detail>)``."""
    if isinstance(error, APIError):
        return error.message
    if isinstance(error, ua.UaStatusCodeError) and error.code is not None:
        detail = ua.StatusCode(error.code).doc
    elif isinstance(error, TimeoutError):
        detail = "no answer in time"
    else:
        detail = str(error) or type(error).__name__
    return f"{status_name(error)} ({detail})"


def failure(action: str, error: BaseException) -> APIError:
    """``error`` as the API error a read answers with: ``"<action> failed: <status> (<detail>)"``."""
    if isinstance(error, APIError):
        return error
    return DeviceError(f"{action} failed: {explain(error)}", status_name(error))


class SessionSecurity(enum.Enum):
    """What an operation needs from the channel. ``ANY`` prefers security but falls back to an endpoint without it
    when the device rejects certlm's client certificate; push management requires ``ENCRYPTED``."""

    ANY = 0
    SIGNED = 1
    ENCRYPTED = 2


@dataclass(frozen=True)
class Endpoint:
    """One endpoint the device offers, with its policy and mode as the spec's bits."""

    description: ua.EndpointDescription
    policy: type[security_policies.SecurityPolicy]
    policy_bit: int
    mode_bit: int

    @classmethod
    def from_description(cls, description: ua.EndpointDescription) -> Endpoint | None:
        """None for endpoints asyncua cannot use (other transports, policies it does not implement)."""
        policy = _POLICY_CLASSES.get(description.SecurityPolicyUri)
        if policy is None or not description.EndpointUrl.startswith(ua.OPC_TCP_SCHEME):
            return None
        return cls(description, policy, POLICY_BITS.get(policy.URI, 0), MODE_BITS[description.SecurityMode])

    @property
    def secure(self) -> bool:
        return self.mode_bit != 0

    @property
    def name(self) -> str:
        """``Basic256Sha256/SignAndEncrypt``, in the spec's names."""
        policy = self.policy.__name__.removeprefix("SecurityPolicy")
        return f"{policy}/{self.description.SecurityMode.name.rstrip('_')}"

    @functools.cached_property
    def certificate(self) -> x509.Certificate | None:
        """The device's application certificate as announced (the leaf when the device sends its chain); parsed once,
        though a session's set-up asks for it twice (the pin's check, the security policy)."""
        return uacrypto.x509_from_der(self.description.ServerCertificate)

    def strength(self) -> tuple[int, int]:
        # The mode decides first: encryption protects the secrets a push carries whatever the policy.
        return self.mode_bit, _POLICY_RANKS.get(self.policy, 0)

    def allowed_by(self, policy_mask: int | None, mode_mask: int | None) -> bool:
        """Whether the entry's masks allow this endpoint; a mask of 0 or None restricts nothing. An endpoint without
        security has no bits, so it is allowed only while the mode mask is unrestricted."""
        if not self.secure:
            return not mode_mask
        return (not policy_mask or bool(self.policy_bit & policy_mask)) and (
            not mode_mask or bool(self.mode_bit & mode_mask)
        )

    def accepts_user(self, token_type: ua.UserTokenType) -> bool:
        tokens = self.description.UserIdentityTokens or []
        matching = [token for token in tokens if token.TokenType == token_type]
        if tokens and not matching:
            return False
        if token_type == ua.UserTokenType.UserName and not self.secure:
            # Without a channel to protect it, a password may only travel encrypted by its token policy.
            return any(
                token.SecurityPolicyUri and token.SecurityPolicyUri != security_policies.SecurityPolicyNone.URI
                for token in matching
            )
        return True


def user_token_type(target: DeviceTarget) -> ua.UserTokenType:
    """Username and password when the entry has a username, else its X.509 user certificate, else anonymous."""
    if target.username:
        return ua.UserTokenType.UserName
    if target.pkcs12:
        return ua.UserTokenType.Certificate
    return ua.UserTokenType.Anonymous


Announced = Sequence[ua.EndpointDescription | Endpoint]
"""The endpoints a device announced (GetEndpoints), as it sent them or already made ``Endpoint``s (``endpoints_of``)."""


def endpoints_of(descriptions: Announced) -> list[Endpoint]:
    """``descriptions`` as ``Endpoint``s, those asyncua can use; an ``Endpoint`` is kept as it is, with the
    certificate it parsed already (a monitor visit reads the announced certificate, then opens its session on the
    same endpoints: the device's certificate is parsed once)."""
    return [
        endpoint
        for d in descriptions
        if (endpoint := d if isinstance(d, Endpoint) else Endpoint.from_description(d)) is not None
    ]


def usable_endpoints(descriptions: Announced, target: DeviceTarget, security: SessionSecurity) -> list[Endpoint]:
    """The endpoints an operation may use, strongest first; a secure endpoint always ranks before one without."""
    token_type = user_token_type(target)
    endpoints = endpoints_of(descriptions)
    usable = [
        endpoint
        for endpoint in endpoints
        if endpoint.allowed_by(target.security_policy, target.security_mode)
        and endpoint.mode_bit >= security.value
        and endpoint.accepts_user(token_type)
    ]
    if not usable:
        offered = ", ".join(sorted({endpoint.name for endpoint in endpoints})) or "none asyncua can use"
        needed = {
            SessionSecurity.ANY: "endpoint",
            SessionSecurity.SIGNED: "Sign or SignAndEncrypt endpoint",
            SessionSecurity.ENCRYPTED: "SignAndEncrypt endpoint",
        }[security]
        status = "BadSecurityModeInsufficient" if security is SessionSecurity.ENCRYPTED else "BadSecurityPolicyRejected"
        raise DeviceError(
            f"{status}: the device offers no {needed} within security_policy mask {target.security_policy or 0} "
            f"and security_mode mask {target.security_mode or 0} that accepts a {token_type.name} user "
            f"(it offers {offered})",
            status,
        )
    return sorted(usable, key=Endpoint.strength, reverse=True)


class TimeLimit:
    """``asyncio.timeout(seconds)`` whose expiry is always ``TimeoutError``. asyncua bounds its requests with
    ``wait_for2``, which raises ``CancelledWithResultError``, a ``CancelledError`` of its own class, when a
    cancellation meets the answer it was waiting for; Python 3.11's ``asyncio.timeout`` turns only ``CancelledError``
    itself into ``TimeoutError`` (3.12 any subclass of it). So a time-out that expired at that very moment escaped as
    a cancellation: on a loaded machine an onboarding failed now and then with 500 "internal error:
    CancelledWithResultError" rather than its step's time-out. A cancellation from outside (the task's own) stays
    one."""

    __slots__ = ("_cancelling", "_task", "_timeout")

    def __init__(self, seconds: float | None) -> None:
        self._timeout = asyncio.timeout(seconds)

    async def __aenter__(self) -> asyncio.Timeout:
        self._task = asyncio.current_task()
        self._cancelling = self._task.cancelling() if self._task is not None else 0
        return await self._timeout.__aenter__()

    async def __aexit__(self, exc_type: Any, exc: Any, traceback: Any) -> bool | None:
        handled = await self._timeout.__aexit__(exc_type, exc, traceback)  # a plain CancelledError: TimeoutError
        if (
            exc_type is not None
            and exc_type is not asyncio.CancelledError
            and issubclass(exc_type, asyncio.CancelledError)
            and self._timeout.expired()
            and self._task is not None
            and self._task.cancelling() <= self._cancelling
        ):
            raise TimeoutError from exc
        return handled


async def server_endpoints(url: str, timeouts: DeviceTimeouts) -> list[ua.EndpointDescription]:
    """GetEndpoints over a channel without security, as every OPC UA client starts."""
    client = Client(url, timeout=timeouts.connect_s)
    # Bounds here are ``asyncio.timeout``, not ``wait_for``: on Python 3.11 ``wait_for`` runs what it bounds in a task
    # of its own, four more per renewal (and per monitor visit) for the same bound.
    async with TimeLimit(timeouts.connect_s):
        return await client.connect_and_get_server_endpoints()


async def server_listens(url: str, timeouts: DeviceTimeouts) -> None:
    """Returns once the device accepts a connection on ``url`` (a TCP connection, closed at once): all a
    device that restarts its endpoints has to show, without the GetEndpoints that decodes every endpoint it offers
    (each with its certificate). Raises ``OSError`` or ``TimeoutError`` while it does not."""
    address = urlsplit(url)
    async with TimeLimit(timeouts.connect_s):
        _, writer = await asyncio.open_connection(address.hostname, address.port or DEFAULT_OPC_TCP_PORT)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


ServerCheck = Callable[[x509.Certificate], None]
"""Called with the certificate the device announces, before anything but GetEndpoints was sent; raises
``DeviceFailure`` to refuse the device (``DeviceIdentityChanged`` for one that is not the device certlm pinned)."""


# What a device answers for a request naming a node it does not have (any more), or a method its object does not
# have: after a firmware update, nodes found in an earlier session may have moved.
UNKNOWN_NODE_STATUSES = frozenset({"BadNodeIdUnknown", "BadNodeIdInvalid", "BadMethodInvalid", "BadAttributeIdInvalid"})


@dataclass(frozen=True)
class Located:
    """The nodes at ``paths`` below ``start`` as one TranslateBrowsePathsToNodeIds found them (None: no such node), or
    as the standard places them (``assumed``: not asked yet, ``DeviceSession.locate``)."""

    start: ua.NodeId
    paths: tuple[tuple[str, ...], ...]
    nodes: tuple[ua.NodeId | None, ...]
    assumed: bool = False


class FoundNodes:
    """What TranslateBrowsePathsToNodeIds found on each device, kept across its sessions (a monitor visit, a push):
    a device's address space stays what it is but for a firmware update, which ``DeviceSession`` notices by the
    device answering that a node is unknown. Bounded: the devices used least recently are forgotten first."""

    MAX_DEVICES = 10_000
    _MAX_SHARED = 256

    def __init__(self, max_devices: int = MAX_DEVICES) -> None:
        self.max_devices = max_devices
        self._devices: OrderedDict[Hashable, dict[str, Located]] = OrderedDict()
        # Devices of one kind resolve the same paths to the same nodes: each distinct answer is kept once.
        self._shared: dict[Located, Located] = {}

    def get(self, device: Hashable) -> dict[str, Located]:
        found = self._devices.get(device)
        if found is None:
            return {}
        self._devices.move_to_end(device)
        return dict(found)

    def put(self, device: Hashable, found: dict[str, Located]) -> None:
        self._devices[device] = {purpose: self._one_of(located) for purpose, located in found.items()}
        self._devices.move_to_end(device)
        while len(self._devices) > self.max_devices:
            self._devices.popitem(last=False)

    def _one_of(self, located: Located) -> Located:
        shared = self._shared.get(located)
        if shared is None and len(self._shared) < self._MAX_SHARED:
            shared = self._shared[located] = located
        return shared or located


found_nodes = PerHost(lambda services: FoundNodes())
"""``found_nodes(services)``: the nodes found on devices by the host that lent ``services``."""


class RememberedEndpoints:
    """The endpoint of each device's last secure session in this process opened on what it announced (a monitor
    visit, a push's verification), for a while: the device's next secure session, a renewal right after the monitor
    scan, opens its channel on it rather than asking GetEndpoints again (a connection, a channel and the decoding of
    every endpoint the device offers, each with its certificate, on certlm and on the device). Nothing is taken on
    trust from it: the secure channel and CreateSession prove the device holds the key of the remembered certificate,
    and a device that does not (it changed its certificate or its endpoints since) is asked GetEndpoints as before
    (``open_session``). One endpoint a device, not all it announced: some 3 kB each rather than 20, for every device
    of a plant's monitor scan. Bounded in age and in the number of devices."""

    MAX_AGE_S = 900.0
    MAX_DEVICES = 10_000

    def __init__(self, max_age_s: float = MAX_AGE_S, max_devices: int = MAX_DEVICES) -> None:
        self.max_age_s, self.max_devices = max_age_s, max_devices
        self._devices: OrderedDict[str, tuple[float, Endpoint]] = OrderedDict()

    def get(self, url: str) -> Endpoint | None:
        kept = self._devices.get(url)
        if kept is None:
            return None
        if time.monotonic() - kept[0] > self.max_age_s:
            del self._devices[url]
            return None
        return kept[1]

    def put(self, url: str, endpoint: Endpoint) -> None:
        self._devices[url] = (time.monotonic(), endpoint)
        self._devices.move_to_end(url)
        while len(self._devices) > self.max_devices:
            self._devices.popitem(last=False)

    def forget(self, url: str) -> None:
        self._devices.pop(url, None)


remembered_endpoints = PerHost(lambda services: RememberedEndpoints())
"""``remembered_endpoints(services)``: the endpoints of devices' last secure sessions with the host of ``services``."""


def device_key(target: DeviceTarget, endpoint: Endpoint) -> Hashable:
    """A device as ``FoundNodes`` knows it: its address and the application it announces, the entry's user and the
    channel's mode (a device may show a user or a channel less of its address space). Its certificate is not part of
    it, so that what was found outlives a renewal; that it is the same device, the pinned certificate says
    (``open_session`` reuses what was found only for a device whose certificate it checked)."""
    return (
        target.url,
        endpoint.description.Server.ApplicationUri,
        user_token_type(target),
        target.username,
        endpoint.mode_bit,
    )


class DeviceSession:
    """An activated session with one device. Every request is bounded by the operation time-out: the client's own
    bound on each request (``_connect``), ``request`` for an operation of several."""

    def __init__(
        self,
        client: Client,
        endpoint: Endpoint,
        timeouts: DeviceTimeouts,
        known: FoundNodes | None = None,
        device: Hashable = None,
        reuse: bool = False,
    ) -> None:
        self.client = client
        self.endpoint = endpoint
        self.timeouts = timeouts
        # Nodes looked up by browse path, by what they are for (``locate``): a device's address space stays what it
        # is, so a second look-up in this session or a later one (``known``) costs no request.
        self._known, self._device = known, device
        self.found: dict[str, Located] = known.get(device) if known is not None and reuse else {}
        # What was found in an earlier session and not looked up again in this one, and where the device has those
        # nodes now if they moved (``_relocated``).
        self._reused = set(self.found)
        self._moved: dict[ua.NodeId, ua.NodeId] = {}
        self._relocated_once = False
        # Every endpoint the device announced when the session was opened (``open_session``): a session of the same
        # operation opened after it, while the device's certificate cannot have changed, needs no GetEndpoints.
        self.announced: Announced = (endpoint,)

    @functools.cached_property
    def server_certificate(self) -> x509.Certificate:
        """The certificate the device presented for this session (parsed once: it stays what it was for the
        session's life)."""
        presented = self.client.security_policy.peer_certificate or self.endpoint.description.ServerCertificate
        return uacrypto.x509_from_der(presented)

    @property
    def security_policy(self) -> int:
        return self.endpoint.policy_bit

    @property
    def security_mode(self) -> int:
        return self.endpoint.mode_bit

    async def request(self, operation: Awaitable[_T]) -> _T:
        """``operation`` of several requests (a Browse and its BrowseNext), bounded as a whole by the operation
        time-out. A single request needs no such bound: the client bounds each request by it (``_connect``), and a
        second bound costs a task and a timer on every request of a push."""
        async with TimeLimit(self.timeouts.operation_s):
            return await operation

    async def call(self, object_id: ua.NodeId, method_id: ua.NodeId, *arguments: ua.Variant) -> list[Any]:
        """Call a method on an object; the output arguments as a list. A Bad result raises its UaStatusCodeError."""
        object_id, method_id = self._current(object_id), self._current(method_id)
        try:
            result = await call_method_full(self.client.get_node(object_id), method_id, *arguments)
        except ua.UaStatusCodeError as error:
            # A call naming an unknown node ran nothing: it may be sent again to where the node moved.
            if status_name(error) in UNKNOWN_NODE_STATUSES and await self._relocated((object_id, method_id)):
                return await self.call(object_id, method_id, *arguments)
            raise
        return result.OutputArguments

    async def call_in_one(
        self, *calls: tuple[ua.NodeId, ua.NodeId, Sequence[ua.Variant]]
    ) -> list[list[Any] | ua.UaStatusCodeError]:
        """Several method calls (object, method, arguments) in one Call request, one round trip; each call's output
        arguments, or the error of its Bad result. The device is asked for nothing again where it answers a node as
        unknown: a caller that needs that falls back to ``call``."""
        requests = [
            ua.CallMethodRequest(
                ObjectId=self._current(object_id), MethodId=self._current(method_id), InputArguments=list(arguments)
            )
            for object_id, method_id, arguments in calls
        ]
        return [
            [variant.Value for variant in result.OutputArguments or []]
            if result.StatusCode.is_good()
            else ua.UaStatusCodeError(result.StatusCode.value)
            for result in await self.client.uaclient.call(requests)
        ]

    async def read_values(self, node_ids: Sequence[ua.NodeId]) -> list[Any]:
        """The values of several variables in one Read; ``None`` for each the device answers with a Bad status."""
        if not node_ids:
            return []
        asked = [self._current(node_id) for node_id in node_ids]
        data_values = await self.client.uaclient.read_attributes(asked, ua.AttributeIds.Value)
        unknown = [
            node_id
            for node_id, value in zip(asked, data_values, strict=True)
            if value.StatusCode is not None
            and not value.StatusCode.is_good()
            and value.StatusCode.name in UNKNOWN_NODE_STATUSES
        ]
        if unknown and await self._relocated(unknown):
            return await self.read_values(node_ids)
        return [_good_value(data_value) for data_value in data_values]

    async def translate(self, start: ua.NodeId, *paths: Sequence[str]) -> list[ua.NodeId | None]:
        """The node at each browse path below ``start`` (``["0:CertificateGroups", "0:DefaultApplicationGroup"]``),
        all in one TranslateBrowsePathsToNodeIds request; ``None`` where the device has no such node."""
        if not paths:
            return []
        relative_paths = [_relative_path(tuple(path)) for path in paths]
        results = await self.client.translate_browsepaths(self._current(start), relative_paths)
        return [
            result.Targets[0].TargetId if result.StatusCode.is_good() and result.Targets else None for result in results
        ]

    async def locate(
        self,
        purpose: str,
        start: ua.NodeId,
        paths: tuple[tuple[str, ...], ...],
        assumed: tuple[ua.NodeId, ...] | None = None,
    ) -> tuple[ua.NodeId | None, ...]:
        """``translate`` of ``paths`` below ``start``, kept by ``purpose`` for this device's later look-ups, in this
        session and later ones (``FoundNodes``). A request that names a node found so in an earlier session and that
        the device answers as unknown has the paths translated again, once per session (``_relocated``).

        ``assumed``: where the standard puts the nodes at ``paths`` (Part 12's ns=0 NodeIds), taken without a request
        while nothing was found for ``purpose``: most devices have them there, and one that does not answers the
        first request naming them as unknown, which has the paths translated then (as for nodes that moved). Only a
        caller that gives ``assumed`` is answered with assumed nodes; another has them translated."""
        located = self.found.get(purpose)
        if located is None or (located.start, located.paths) != (start, paths) or (located.assumed and not assumed):
            if assumed is not None:
                located = Located(start, paths, assumed, assumed=True)
                self._reused.add(purpose)  # checked by the device's answers, as what an earlier session found
            else:
                located = Located(start, paths, tuple(await self.translate(start, *paths)))
                self._reused.discard(purpose)
            self.found[purpose] = located
            self._keep()
        return located.nodes

    def _keep(self) -> None:
        if self._known is not None:
            self._known.put(self._device, self.found)

    def _current(self, node_id: ua.NodeId) -> ua.NodeId:
        """Where the device has ``node_id`` now (``_relocated``)."""
        return self._moved.get(node_id, node_id) if self._moved else node_id

    async def _relocated(self, nodes: Collection[ua.NodeId]) -> bool:
        """Called when the device answered that some of ``nodes`` are unknown: where one of them was found in an
        earlier session, what was found then is translated again (once per session: a device answering so for
        another reason costs one request); whether one of ``nodes`` moved, and requests naming it go to its new
        place from then on."""
        reused = {node for purpose in self._reused for node in self.found[purpose].nodes if node is not None}
        if self._relocated_once or reused.isdisjoint(nodes):
            return False
        self._relocated_once = True
        for purpose in sorted(self._reused):
            before = self.found[purpose]
            after = replace(before, nodes=tuple(await self.translate(before.start, *before.paths)), assumed=False)
            self.found[purpose] = after
            # A node the device does not have at all is asked for where it was, and answered as unknown again.
            self._moved |= {
                old: new
                for old, new in zip(before.nodes, after.nodes, strict=True)
                if old is not None and new is not None and new != old
            }
        self._reused.clear()
        self._keep()
        moved = [node for node in nodes if self._moved.get(node) is not None]
        if moved:
            url = self.client.server_url.geturl()
            log.info("%s: nodes found in an earlier session moved (a firmware update?): found again", url)
        return bool(moved)

    async def children(self, node_id: ua.NodeId) -> list[ua.ReferenceDescription]:
        """The hierarchical children of a node (each once, however many references lead to it)."""
        node_id = self._current(node_id)
        try:
            references = await self.request(
                self.client.get_node(node_id).get_children_descriptions(refs=ua.ObjectIds.HierarchicalReferences)
            )
        except ua.UaStatusCodeError as error:
            if status_name(error) in UNKNOWN_NODE_STATUSES and await self._relocated((node_id,)):
                return await self.children(node_id)
            raise
        unique: dict[ua.NodeId, ua.ReferenceDescription] = {}
        for reference in references:
            unique.setdefault(reference.NodeId, reference)
        return list(unique.values())

    async def close(self) -> None:
        """Close the session; a device that is gone or restarting is not an error here."""
        try:
            # In a task of its own (``wait_for``), once per session: a device that restarts its endpoints as soon
            # as it answered ApplyChanges listens again by the time the next session is opened on them (opened a
            # turn of the event loop sooner, it found nothing listening and asked GetEndpoints again: test_sessions).
            await asyncio.wait_for(self.client.disconnect(), self.timeouts.connect_s)
        except Exception as error:
            log.debug("closing the session with %s: %s", self.client.server_url.geturl(), status_name(error))
        finally:
            self.client.disconnect_socket()


@functools.lru_cache(maxsize=256)
def _relative_path(path: tuple[str, ...]) -> ua.RelativePath:
    """A browse path as the request encodes it, parsed once: asyncua parses a path string each time it is asked (tens
    of microseconds a path, and a visit asks for a score of paths). Shared, so never changed."""
    return ua.RelativePath.from_string("/" + "/".join(path))


@asynccontextmanager
async def open_session(
    target: DeviceTarget,
    identity: ClientIdentity,
    timeouts: DeviceTimeouts,
    security: SessionSecurity = SessionSecurity.ANY,
    check_server: ServerCheck | None = None,
    on_client_rejected: Callable[[], None] | None = None,
    announced: Announced | None = None,
    known: FoundNodes | None = None,
    remembered: RememberedEndpoints | None = None,
) -> AsyncIterator[DeviceSession]:
    """A session on the strongest endpoint the entry's masks allow, as certlm's client application and the entry's
    user. With ``SessionSecurity.ANY`` a device that rejects certlm's client certificate is read without security
    instead, when the masks allow that. ``on_client_rejected`` is called when the device rejects the client
    certificate, whether the session then goes on without security or fails. ``announced``: the endpoints the device
    announced moments ago in the same operation (GetEndpoints is then not asked again); the secure channel verifies
    the certificate the device presents whatever was announced. ``known``: the nodes found on devices in earlier
    sessions (``DeviceSession.locate``). ``remembered``: the endpoints of devices' last secure sessions
    (``RememberedEndpoints``), the device's tried first where ``announced`` is not given, and the endpoint of a secure
    session opened on what the device announced kept there."""
    session = None
    if announced is None and remembered is not None and (kept := remembered.get(target.url)) is not None:
        try:
            session = await _on_remembered(kept, target, identity, timeouts, security, check_server, known)
        finally:
            if session is None:  # the next session asks what the device announces now
                remembered.forget(target.url)
    if session is None:
        offered = endpoints_of(announced if announced is not None else await server_endpoints(target.url, timeouts))
        session = await _on_announced(
            offered, target, identity, timeouts, security, check_server, on_client_rejected, known
        )
        if remembered is not None and session.endpoint.secure:
            # Only an endpoint a secure session just opened on: a device that refuses certlm's client certificate (read
            # without security) would refuse a session on it again before being asked.
            remembered.put(target.url, session.endpoint)
    try:
        yield session
    finally:
        await session.close()


async def _on_remembered(
    kept: Endpoint,
    target: DeviceTarget,
    identity: ClientIdentity,
    timeouts: DeviceTimeouts,
    security: SessionSecurity,
    check_server: ServerCheck | None,
    known: FoundNodes | None,
) -> DeviceSession | None:
    """A session on ``kept``, the endpoint of the device's last secure session (``RememberedEndpoints``), where the
    session asked for may use it, it presented the certificate certlm pinned, and the device still holds that
    certificate's key (the channel and CreateSession prove it). None (then the device is asked GetEndpoints) where
    the session may not use it, its certificate is not the pinned one or not what ``check_server`` wants, or the
    device refuses the channel, leaves it unanswered or closes the connection. Any other failure is the session's: a
    device that refuses the session's user, or does not answer at all."""
    try:
        endpoint = usable_endpoints([kept], target, security)[0]
    except DeviceFailure:
        return None
    if not endpoint.secure or endpoint.certificate is None:
        return None  # only a secure channel proves whose the remembered certificate is
    if target.pinned_certificate is None or to_der(endpoint.certificate) != target.pinned_certificate:
        # Not the certificate certlm pinned: a device at first contact (or onboarded again: replaced?), or one that a
        # push since installed a certificate in (this instance's or another's: the pin is the database's).
        return None
    if check_server is not None:
        try:
            check_server(endpoint.certificate)
        except DeviceFailure:
            return None
    try:
        session = await _connect(target, identity, timeouts, endpoint, known, reuse=check_server is not None)
    except Exception as error:
        if not _refused_remembered(error):
            raise
        # A device that drops such a request unanswered costs the connect time-out once, not at every session.
        log.debug("%s: the endpoint of its last session does not open (%s)", target.url, status_name(error))
        return None
    return session


def _refused_remembered(error: BaseException) -> bool:
    """Whether a session on remembered endpoints failed as one on endpoints the device no longer has does: the channel
    refused, unanswered (``SecureChannelUnanswered``) or the connection closed (a device that no longer offers the
    policy, or cannot decrypt what was encrypted for a key it no longer holds), a signature that the remembered
    certificate does not verify, or asyncua finding the certificate the device presents in CreateSession is not the
    one it was given. Not a device that refuses the session's user, or does not answer at all: asking GetEndpoints
    first would not change that."""
    if _client_rejected(error) or isinstance(error, ConnectionError | InvalidSignature | SecureChannelUnanswered):
        return True
    return isinstance(error, ua.UaError) and not isinstance(error, ua.UaStatusCodeError)


async def _on_announced(
    offered: Sequence[Endpoint],
    target: DeviceTarget,
    identity: ClientIdentity,
    timeouts: DeviceTimeouts,
    security: SessionSecurity,
    check_server: ServerCheck | None,
    on_client_rejected: Callable[[], None] | None,
    known: FoundNodes | None,
) -> DeviceSession:
    """A session on the strongest of the endpoints ``offered`` (``open_session``)."""
    endpoints = usable_endpoints(offered, target, security)
    attempts = endpoints[:1]
    if security is SessionSecurity.ANY and endpoints[0].secure and not endpoints[-1].secure:
        attempts.append(endpoints[-1])
    session: DeviceSession | None = None
    for attempt, endpoint in enumerate(attempts):
        if check_server is not None and endpoint.certificate is not None:
            check_server(endpoint.certificate)
        try:
            # Only a device that passed ``check_server`` (the certificate certlm pinned) is the one whose nodes were
            # found before: a device trusted on first use (another one at the same address?) has its nodes found anew.
            session = await _connect(target, identity, timeouts, endpoint, known, reuse=check_server is not None)
            break
        except Exception as error:
            if not _client_rejected(error):
                raise
            if on_client_rejected is not None:
                on_client_rejected()
            if attempt + 1 == len(attempts):
                raise client_not_trusted(identity, error) from error
            log.info(
                "%s rejects certlm's client certificate on %s: reading without security", target.url, endpoint.name
            )
    assert session is not None
    session.announced = offered
    return session


def certificate_name(certificate: x509.Certificate) -> str:
    """A certificate as messages name it: its subject and SHA-1 thumbprint, what OPC UA tools show."""
    return f"{certificate.subject.rfc4514_string()} (SHA-1 {sha1_fingerprint(certificate)})"


def client_not_trusted(identity: ClientIdentity, error: BaseException) -> DeviceError:
    """What to do about a device that refuses certlm's client certificate, with the status it answered."""
    return DeviceError(
        f"the device refuses certlm's client certificate ({status_name(error)}): it must trust "
        f"{certificate_name(identity.certificate)}. Download it with "
        "GET /gds/crt, add it to the device's trusted certificates (or put the device in its factory state that "
        "accepts the first client), then retry",
        status_name(error),
    )


def _client_rejected(error: BaseException) -> bool:
    """Whether a secure session failed because the device does not trust certlm's client certificate (yet)."""
    status = status_name(error)
    return status in {"BadSecurityChecksFailed", "BadSecurityPolicyRejected"} or status.startswith("BadCertificate")


def _good_value(data_value: ua.DataValue) -> Any:
    if data_value.StatusCode is not None and not data_value.StatusCode.is_good():
        return None
    return data_value.Value.Value if data_value.Value is not None else None


async def _connect(
    target: DeviceTarget,
    identity: ClientIdentity,
    timeouts: DeviceTimeouts,
    endpoint: Endpoint,
    known: FoundNodes | None = None,
    reuse: bool = False,
) -> DeviceSession:
    # ``timeout``: the bound on each request of the session (DeviceSession's single requests have no other).
    # ``watchdog_intervall``: asyncua reads the server state every second of a session by default and takes a read
    # unanswered within that second for a lost connection; a device busy making a CSR's key (seconds on a real PLC)
    # answered the next request with "client is disconnected", and each read cost a round trip. certlm bounds its
    # requests itself and a dropped socket still ends the session at once, so no read is sent within its life.
    client = Client(target.url, timeout=timeouts.operation_s, watchdog_intervall=SESSION_TIMEOUT_MS / 1000)
    # A certlm session lasts seconds; servers grant at most what they allow (asyncua's 10 minutes), and asking
    # for more only makes asyncua warn on every connection.
    client.session_timeout = SESSION_TIMEOUT_MS
    client.application_uri = identity.application_uri  # must equal the certificate's URI SAN
    client.name = client.description = "certlm"
    if endpoint.secure:
        # The policy is built from the identity's parsed key and certificates, as asyncua's set_security would after
        # parsing them from bytes for every session: cryptography checks an RSA key's math on each load (tens of ms
        # of CPU on the event loop, most of what a monitor read cost).
        client.security_policy = endpoint.policy(
            endpoint.certificate,
            identity.certificate,
            identity.private_key,
            endpoint.description.SecurityMode,
            host_cert_chain=list(identity.chain),
        )
        client.uaclient.set_security(client.security_policy)
    _set_user(client, target)
    async with client.uaclient.subscribe_state() as states:
        try:
            async with TimeLimit(timeouts.connect_s):
                await client.connect()
        except ConnectionError as error:
            client.disconnect_socket()
            if endpoint.secure and UaClientState.CHANNEL_OPEN not in await _states_seen(states):
                # A device that refuses certlm's certificate answers OpenSecureChannel with an error message; the
                # one node-opcua sends asyncua cannot decode, so all that arrives is the closed connection.
                raise DeviceError(
                    f"the device closed the connection when certlm opened a {endpoint.name} secure channel: it does "
                    "not accept certlm's client certificate (BadSecurityChecksFailed)",
                    "BadSecurityChecksFailed",
                ) from error
            raise
        except BaseException as error:
            unanswered = isinstance(error, TimeoutError) and _secure_channel_unanswered(client)
            client.disconnect_socket()
            if unanswered:
                unanswered_on = f"the device did not answer OpenSecureChannel on {endpoint.name}"
                raise SecureChannelUnanswered(unanswered_on) from error
            raise
    if known is None:
        return DeviceSession(client, endpoint, timeouts)
    return DeviceSession(client, endpoint, timeouts, known, device_key(target, endpoint), reuse)


class SecureChannelUnanswered(TimeoutError):
    """The device took the connection and answered Hello, then let OpenSecureChannel go unanswered until the connect
    time-out: what asyncua's server does with a request for a security policy it does not offer or encrypted for a key
    it does not hold (it logs the failure and drops the message). A time-out as any other, but for a session on
    remembered endpoints (``_refused_remembered``)."""


def _secure_channel_unanswered(client: Client) -> bool:
    # asyncua keeps the OpenSecureChannel parameters it sent until the response replaces them.
    protocol = client.uaclient.protocol
    exchange = getattr(protocol, "_open_secure_channel_exchange", None) if protocol is not None else None
    return isinstance(exchange, ua.OpenSecureChannelParameters)


async def _states_seen(states: StateSubscription) -> list[UaClientState]:
    seen = []
    with contextlib.suppress(TimeoutError):
        while True:  # the transitions are queued already; the short wait only ends the loop
            seen.append(await states.next_change(timeout=0.01))
    return seen


def _set_user(client: Client, target: DeviceTarget) -> None:
    token_type = user_token_type(target)
    if token_type == ua.UserTokenType.UserName:
        client.set_user(target.username or "")
        client.set_password(target.password or "")
    elif token_type == ua.UserTokenType.Certificate:
        password = target.pkcs12_password.encode() if target.pkcs12_password else None
        try:
            key, certificate, chain = pkcs12.load_key_and_certificates(target.pkcs12 or b"", password)
        except (ValueError, TypeError):
            raise DeviceError(
                "the entry's user PKCS#12 cannot be read with its stored password", "BadIdentityTokenInvalid"
            ) from None
        if key is None or certificate is None:
            raise DeviceError("the entry's user PKCS#12 holds no certificate and key", "BadIdentityTokenInvalid")
        client.user_certificate, client.user_private_key, client.user_certificate_chain = certificate, key, chain


# What a device answers when the connection or session under a request went away, or a request got no answer in
# time: a fresh session may well go through. A refusal (BadUserAccessDenied, BadCertificateInvalid, ...) would not.
TRANSIENT_STATUSES = frozenset(
    {
        "BadCommunicationError",
        "BadConnectionClosed",
        "BadNoCommunication",
        "BadSecureChannelClosed",
        "BadSecureChannelIdInvalid",
        "BadSessionClosed",
        "BadSessionIdInvalid",
        "BadSessionNotActivated",
        "BadServerNotConnected",
        "BadTcpInternalError",
        "BadRequestTimeout",
        "BadTimeout",
    }
)


def is_transient(error: BaseException | None) -> bool:
    """Whether ``error`` is the connection to the device failing rather than the device or certlm refusing: a
    dropped channel or session (asyncua's ``ConnectionError``, a reset, EOF, ``TRANSIENT_STATUSES``) or one request
    without an answer in time. certlm's own verdicts (``DeviceFailure``), a PKI's errors, and a device that refuses
    connections or a name that does not resolve (it is down, not dropping) are not."""
    if error is None or isinstance(error, APIError | ConnectionRefusedError | socket.gaierror):
        return False
    if isinstance(error, ua.UaStatusCodeError):
        return status_name(error) in TRANSIENT_STATUSES
    return isinstance(error, TimeoutError | ConnectionError | EOFError | asyncio.IncompleteReadError)
