"""The server side of OPC UA Part 12 push certificate management: ServerConfiguration and TrustList methods.

The behaviour and status codes are summarised in the package docstring.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from itertools import pairwise
from typing import Any

from asyncua import Server, ua
from asyncua.common.node import Node
from asyncua.common.utils import Buffer
from asyncua.ua import uaerrors
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import rsa

from .address_space import renumber
from .config import DropPoint, FailurePoint, SimulatorConfig
from .pki import (
    TrustList,
    application_uris,
    create_signing_request,
    der_of,
    is_self_signed,
    issued_by,
    issuing_crl,
    load_pushed_private_key,
    parse_subject_name,
    same_public_key,
    thumbprint,
    valid_now,
    verify_client_certificate,
    verify_own_certificate_chain,
)
from .store import DeviceState, StateFolder

_logger = logging.getLogger(__name__)

DEFAULT_APPLICATION_GROUP = ua.NodeId(ua.ObjectIds.ServerConfiguration_CertificateGroups_DefaultApplicationGroup)
CERTIFICATE_TYPE = ua.NodeId(ua.ObjectIds.RsaSha256ApplicationCertificateType)
_SERVER_CONFIGURATION = ua.NodeId(ua.ObjectIds.ServerConfiguration)
_TRUST_LIST = ua.NodeId(ua.ObjectIds.ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList)
_TRUST_LIST_IDS = "ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList"
_READ = ua.OpenFileMode.Read
_WRITE_ERASING = ua.OpenFileMode.Write | ua.OpenFileMode.EraseExisting
_ALL_FILE_MODES = ua.OpenFileMode.Read | ua.OpenFileMode.Write | ua.OpenFileMode.EraseExisting | ua.OpenFileMode.Append


@dataclass(frozen=True)
class Caller:
    """Who calls: the session's user object (its identity stands for the session) and the channel's mode."""

    user: Any
    mode: ua.MessageSecurityMode


current_caller: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("current_caller", default=None)
"""Set for every request of a session before asyncua processes it (see device.ChannelRuleset)."""


@dataclass(frozen=True)
class _PendingCertificate:
    certificate: x509.Certificate
    private_key: rsa.RSAPrivateKey
    issuers: tuple[bytes, ...]


@dataclass
class _Transaction:
    owner: Any
    certificate: _PendingCertificate | None = None
    trust_list: TrustList | None = None
    present_certificate: bool = False
    """A certificate applied at once during the transaction: the endpoints present it when the transaction ends,
    so that dropping the channels does not discard the trust list still pending in it."""


@dataclass
class _OpenFile:
    owner: Any
    writing: bool
    data: bytearray = field(default_factory=bytearray)
    position: int = 0


@dataclass(frozen=True)
class _Method:
    name: str
    node: int
    owner: ua.NodeId
    handler: Callable[..., Awaitable[list[ua.Variant]]]
    step: str | Callable[[list[Any]], str | None] | None = None
    """The ``FAILURE_STEPS`` entry a call belongs to, or a function of the call's input values naming it."""


class PushManagement:
    """Part 12 push certificate management of one device, over its ``DeviceState``."""

    def __init__(
        self,
        server: Server,
        state: DeviceState,
        store: StateFolder,
        config: SimulatorConfig,
        *,
        on_applied: Callable[[], None],
        on_drop: Callable[[], None],
        on_disconnect: Callable[[Any], None] = lambda user: None,
    ) -> None:
        self._server = server
        self._state = state
        self._store = store
        self._config = config
        self._on_applied = on_applied
        self._on_drop = on_drop
        self._on_disconnect = on_disconnect
        self._drop: DropPoint | None = config.drop
        self._drops_left = self._drop.count if self._drop else None
        self._label = f"{config.host}:{config.port}"
        self._failure: FailurePoint | None = config.failure
        self._failures_left = config.fail_count
        self._calls_before_failing = config.fail_after
        self._transaction: _Transaction | None = None
        self._csr_key: rsa.RSAPrivateKey | None = None
        self._files: dict[int, _OpenFile] = {}
        self._last_handle = 0
        # How a test counts the writes that reached the device (two operators approving at once: one write).
        self.trust_list_changes = 0
        # Well-known NodeId -> the one the device gives the node (``SimulatorConfig.node_generation``).
        self._node_ids: dict[ua.NodeId, ua.NodeId] = {}

    async def install(self) -> None:
        """Publish the ServerConfiguration and TrustList properties and bind the methods."""
        ids = ua.ObjectIds
        await self._write(ids.ServerConfiguration_ApplicationUri, self._config.effective_application_uri)
        await self._write(ids.ServerConfiguration_ProductUri, self._server.product_uri)
        await self._write(ids.ServerConfiguration_ApplicationType, ua.ApplicationType.Server, ua.VariantType.Int32)
        await self._write(
            ids.ServerConfiguration_SupportedPrivateKeyFormats,
            list(self._config.private_key_formats),
            ua.VariantType.String,
        )
        await self._write(
            ids.ServerConfiguration_MaxTrustListSize, self._config.max_trust_list_size, ua.VariantType.UInt32
        )
        await self._write(ids.ServerConfiguration_MulticastDnsEnabled, False)
        await self._write(ids.ServerConfiguration_HasSecureElement, False)
        await self._write(ids.ServerConfiguration_ServerCapabilities, ["DA"], ua.VariantType.String)
        await self._write(
            ids.ServerConfiguration_CertificateGroups_DefaultApplicationGroup_CertificateTypes,
            [CERTIFICATE_TYPE],
            ua.VariantType.NodeId,
        )
        await self._write(getattr(ids, f"{_TRUST_LIST_IDS}_Writable"), True)
        await self._write(getattr(ids, f"{_TRUST_LIST_IDS}_UserWritable"), True)
        self._server.set_attribute_value_callback(
            ua.NodeId(getattr(ids, f"{_TRUST_LIST_IDS}_OpenCount")), self._open_count
        )
        await self._publish_trust_list_properties()
        await self._hide_unsupported_certificate_groups()
        await self._add_get_certificates()
        for method in self._methods():
            node = self._server.get_node(ua.NodeId(method.node))
            self._server.link_method(node, self._dispatcher(method, await _input_arguments(node)))
        if generation := self._config.node_generation:
            self._node_ids = renumber(
                self._server.iserver.aspace,
                _TRUST_LIST,
                lambda old: ua.NodeId(f"TrustList.{generation}.{old.Identifier}", 1, ua.NodeIdType.String),
            )

    def _methods(self) -> list[_Method]:
        ids, config = ua.ObjectIds, _SERVER_CONFIGURATION

        def trust_list(name: str, handler: Callable[..., Awaitable[list[ua.Variant]]], step: Any = None) -> _Method:
            return _Method(name, getattr(ids, f"{_TRUST_LIST_IDS}_{name}"), _TRUST_LIST, handler, step)

        def opens_for_writing(values: list[Any]) -> str | None:
            mode = values[0]
            return "trust_list_write" if isinstance(mode, int) and mode & ua.OpenFileMode.Write else "trust_list_read"

        return [
            _Method(
                "CreateSigningRequest",
                ids.ServerConfiguration_CreateSigningRequest,
                config,
                self.create_signing_request,
                "create_signing_request",
            ),
            _Method(
                "UpdateCertificate",
                ids.ServerConfiguration_UpdateCertificate,
                config,
                self.update_certificate,
                "update_certificate",
            ),
            _Method("ApplyChanges", ids.ServerConfiguration_ApplyChanges, config, self.apply_changes, "apply_changes"),
            _Method("CancelChanges", ids.ServerConfiguration_CancelChanges, config, self.cancel_changes),
            _Method(
                "GetRejectedList",
                ids.ServerConfiguration_GetRejectedList,
                config,
                self.get_rejected_list,
                "get_rejected_list",
            ),
            _Method("GetCertificates", ids.ServerConfiguration_GetCertificates, config, self.get_certificates),
            _Method("ResetToServerDefaults", ids.ServerConfiguration_ResetToServerDefaults, config, self.not_supported),
            trust_list("Open", self.open, opens_for_writing),
            trust_list("OpenWithMasks", self.open_with_masks, "trust_list_read"),
            trust_list("Read", self.read),
            trust_list("Write", self.write, "trust_list_write"),
            trust_list("GetPosition", self.get_position),
            trust_list("SetPosition", self.set_position),
            trust_list("Close", self.close),
            trust_list("CloseAndUpdate", self.close_and_update, "trust_list_write"),
            trust_list("AddCertificate", self.add_certificate),
            trust_list("RemoveCertificate", self.remove_certificate),
        ]

    def _dispatcher(self, method: _Method, arguments: list[ua.Argument]) -> Callable[..., Awaitable[Any]]:
        async def call(object_id: ua.NodeId, *inputs: ua.Variant) -> Any:
            caller = current_caller.get()
            user = getattr(caller.user, "name", None) if caller else None
            if object_id != self._node_id(method.owner):
                return self._result(method.name, user, ua.StatusCodes.BadMethodInvalid)
            mismatch = _argument_mismatch(arguments, inputs)
            if mismatch is not None:
                self._log(method.name, user, mismatch.StatusCode.value)
                return mismatch
            values = [variant.Value for variant in inputs]
            try:
                _authorize(caller)
                if self._drops_at(_drop_step(method.name, values), caller):
                    return ua.StatusCode(ua.StatusCodes.BadCommunicationError)  # never sent: the connection is gone
                failure = self._failure_at(method.step(values) if callable(method.step) else method.step)
                if failure is not None and failure.drop:
                    _logger.info("%s %s by %s: the device goes down", self._label, method.name, user or "anonymous")
                    self._on_drop()  # the answer below never leaves: every connection is gone
                    return ua.StatusCode(failure.status)
                if failure is not None:
                    return self._result(method.name, user, failure.status)
                outputs = await method.handler(caller, *values)
            except uaerrors.UaStatusCodeError as error:
                return self._result(method.name, user, error.code)
            self._log(method.name, user, ua.StatusCodes.Good)
            if method.name == "ApplyChanges" and self._drops_at("applied", caller):
                return ua.StatusCode(ua.StatusCodes.BadCommunicationError)  # the changes are in; the answer is lost
            return outputs

        return call

    def _result(self, method: str, user: str | None, status: int) -> ua.StatusCode:
        self._log(method, user, status)
        return ua.StatusCode(status)

    def _log(self, method: str, user: str | None, status: int) -> None:
        _logger.info("%s %s by %s: %s", self._label, method, user or "anonymous", ua.StatusCode(status).name)

    def _drops_at(self, step: str | None, caller: Caller | None) -> bool:
        """Whether this call of ``step`` cuts the caller's connection (``drop_at``, counting it); if so the caller's
        session is closed as the device sees it, its pending changes discarded, before the next request arrives."""
        if self._drop is None or caller is None or step != self._drop.step:
            return False
        if self._drops_left is not None:
            if self._drops_left <= 0:
                return False
            self._drops_left -= 1
        _logger.info("%s %s by %s: the connection is dropped", self._label, step, getattr(caller.user, "name", None))
        self.session_closed(caller.user)
        self._on_disconnect(caller.user)
        return True

    def _failure_at(self, step: str | None) -> FailurePoint | None:
        """The injected failure of this call of ``step``, if any (counting it against ``fail_count``)."""
        if self._failure is None or step != self._failure.step:
            return None
        if self._calls_before_failing > 0:
            self._calls_before_failing -= 1
            return None
        if self._failures_left is not None:
            if self._failures_left <= 0:
                return None
            self._failures_left -= 1
        return self._failure

    # ServerConfiguration methods

    async def create_signing_request(
        self,
        caller: Caller,
        group_id: ua.NodeId | None,
        type_id: ua.NodeId | None,
        subject_name: str | None,
        regenerate_private_key: bool,
        nonce: bytes | None,
    ) -> list[ua.Variant]:
        if not self._config.can_create_csr:
            raise uaerrors.BadNotSupported()
        _check_group_and_type(group_id, type_id)
        try:
            subject = parse_subject_name(subject_name) if subject_name else self._state.certificate.subject
        except ValueError as error:
            raise uaerrors.BadInvalidArgument(str(error)) from error
        if regenerate_private_key and not self._config.fixed_key:
            if len(nonce or b"") < 32:
                raise uaerrors.BadInvalidArgument("regeneratePrivateKey needs a nonce of at least 32 bytes")
            self._refuse_foreign_transaction(caller)
            key = await asyncio.to_thread(rsa.generate_private_key, 65537, self._config.csr_key_bits)
            self._csr_key = key
        else:
            key = self._state.private_key
        request = create_signing_request(key, subject, self._state.certificate)
        return [ua.Variant(request, ua.VariantType.ByteString)]

    async def update_certificate(
        self,
        caller: Caller,
        group_id: ua.NodeId | None,
        type_id: ua.NodeId | None,
        certificate: bytes | None,
        issuer_certificates: list[bytes] | None,
        private_key_format: str | None,
        private_key: bytes | None,
    ) -> list[ua.Variant]:
        self._refuse_foreign_transaction(caller)
        _check_group_and_type(group_id, type_id)
        if private_key and private_key_format not in self._config.private_key_formats:
            raise uaerrors.BadNotSupported(f"private key format {private_key_format!r} is not supported")
        try:
            new = x509.load_der_x509_certificate(certificate or b"")
            issuers = [x509.load_der_x509_certificate(der) for der in issuer_certificates or ()]
        except ValueError as error:
            raise uaerrors.BadCertificateInvalid(str(error)) from error
        public_key = new.public_key()
        if not isinstance(public_key, rsa.RSAPublicKey) or public_key.key_size < 2048:
            raise uaerrors.BadCertificateInvalid("an RsaSha256ApplicationCertificate needs an RSA key of 2048+ bits")
        if not valid_now(new):
            raise uaerrors.BadCertificateTimeInvalid()
        if self._config.effective_application_uri not in application_uris(new):
            raise uaerrors.BadCertificateUriInvalid()
        self._check_issuers(caller, new, issuers)
        if not self._config.lenient and not is_self_signed(new):
            status = verify_own_certificate_chain(new, issuers, self._trust_list_for(caller))
            if status is not None:
                raise uaerrors.UaStatusCodeError(status)
        key = load_pushed_private_key(private_key_format or "", private_key) if private_key else self._key_matching(new)
        if not same_public_key(new, key):
            raise uaerrors.BadSecurityChecksFailed("the private key does not match the certificate")
        pending = _PendingCertificate(new, key, tuple(der_of(issuer) for issuer in issuers))
        if self._config.certificate_applies_at_once:
            self._install_certificate(pending)
            if self._transaction is not None:  # the caller's own: another session's was refused above
                self._transaction.present_certificate = True
            else:
                self._on_applied()
            return [ua.Variant(False, ua.VariantType.Boolean)]
        transaction = self._join_transaction(caller)
        transaction.certificate = pending
        return [ua.Variant(True, ua.VariantType.Boolean)]

    def _check_issuers(self, caller: Caller, certificate: x509.Certificate, issuers: list[x509.Certificate]) -> None:
        if issuers:
            for child, parent in pairwise([certificate, *issuers]):
                if not issued_by(child, parent):
                    raise uaerrors.BadCertificateInvalid("the certificate chain does not verify")
            if not all(valid_now(issuer) for issuer in issuers):
                raise uaerrors.BadCertificateIssuerTimeInvalid()
            return
        if is_self_signed(certificate):
            return
        known = [x509.load_der_x509_certificate(der) for der in self._trust_list_for(caller).certificates_der()]
        if not any(issued_by(certificate, ca) for ca in known):
            raise uaerrors.BadCertificateChainIncomplete("issuer not given and not in the trust list")

    def _key_matching(self, certificate: x509.Certificate) -> rsa.RSAPrivateKey:
        for key in (self._csr_key, self._state.private_key):
            if key is not None and same_public_key(certificate, key):
                return key
        raise uaerrors.BadSecurityChecksFailed("the certificate matches neither the CSR key nor the current key")

    def _install_certificate(self, pending: _PendingCertificate) -> None:
        self._state.certificate = pending.certificate
        self._state.private_key = pending.private_key
        self._state.issuers = pending.issuers
        self._csr_key = None
        self._store.save_certificate(self._state)
        self._store.record_installation(pending.certificate)

    async def apply_changes(self, caller: Caller) -> list[ua.Variant]:
        transaction = self._own_transaction(caller)
        if any(file.writing for file in self._files.values()):
            raise uaerrors.BadInvalidState("the TrustList is still open for writing")
        self._transaction = None
        if transaction.certificate is None and self._config.keeps_abandoned_changes and self._csr_key is not None:
            # node-opcua moves the pending key in whatever else the ApplyChanges is for.
            _logger.warning("%s: ApplyChanges takes in the key of an abandoned CreateSigningRequest", self._label)
            self._state.private_key, self._csr_key = self._csr_key, None
            self._store.save_certificate(self._state)
            transaction.present_certificate = True
        if transaction.certificate is not None:
            self._install_certificate(transaction.certificate)
        if transaction.trust_list is not None:
            await self._set_trust_list(transaction.trust_list)
        if transaction.certificate is not None or transaction.trust_list is not None or transaction.present_certificate:
            self._on_applied()
        return []

    async def cancel_changes(self, caller: Caller) -> list[ua.Variant]:
        if self._config.keeps_abandoned_changes:
            raise uaerrors.BadNotImplemented("CancelChanges is not implemented")
        transaction = self._own_transaction(caller)
        self._end_transaction(transaction)
        # A TrustList still open for writing belonged to the transaction.
        self._files = {
            handle: file for handle, file in self._files.items() if not file.writing or file.owner is not caller.user
        }
        return []

    async def get_rejected_list(self, caller: Caller) -> list[ua.Variant]:
        return [ua.Variant(list(self._state.rejected), ua.VariantType.ByteString)]

    async def get_certificates(self, caller: Caller, group_id: ua.NodeId | None) -> list[ua.Variant]:
        _check_group_and_type(group_id, None)
        return [
            ua.Variant([CERTIFICATE_TYPE], ua.VariantType.NodeId),
            ua.Variant([der_of(self._state.certificate)], ua.VariantType.ByteString),
        ]

    async def not_supported(self, caller: Caller) -> list[ua.Variant]:
        raise uaerrors.BadNotSupported()

    # TrustList file methods

    async def open(self, caller: Caller, mode: int) -> list[ua.Variant]:
        if not mode or mode & ~_ALL_FILE_MODES:
            raise uaerrors.BadInvalidArgument(f"{mode} is not an OpenFileMode")
        if mode == _READ:
            return self._open(caller, writing=False, masks=ua.TrustListMasks.All)
        if mode == _WRITE_ERASING:
            return self._open(caller, writing=True)
        # Part 12 7.8.2.1: a TrustList opens only for Read or for Write + EraseExisting.
        raise uaerrors.BadNotSupported(f"mode {mode} is not supported for a TrustList")

    async def open_with_masks(self, caller: Caller, masks: int) -> list[ua.Variant]:
        if masks & ~ua.TrustListMasks.All:
            raise uaerrors.BadInvalidArgument(f"{masks} is not a TrustListMasks value")
        return self._open(caller, writing=False, masks=masks)

    def _open(self, caller: Caller, *, writing: bool, masks: int = 0) -> list[ua.Variant]:
        if not self._config.lenient and self._transaction is not None and self._transaction.certificate is not None:
            # open62541 (src/server/ua_server_ns0_gds.c, openTrustList and openTrustListWithMask) answers every Open,
            # for reading too, with BadTransactionPending while any session's transaction is pending; here while it
            # holds a certificate, which is what forces a client to write the trust list first.
            raise uaerrors.BadTransactionPending("a certificate update is pending: the TrustList does not open")
        if writing:
            self._refuse_foreign_transaction(caller)
            if self._files:
                raise uaerrors.BadInvalidState("the TrustList is open")
            if not self._config.trust_list_applies_at_once:
                self._join_transaction(caller)
            file = _OpenFile(caller.user, writing=True)
        else:
            if not self._config.trust_list_readable:
                raise uaerrors.BadUserAccessDenied("this device does not let its TrustList be read")
            if any(file.writing for file in self._files.values()):
                raise uaerrors.BadInvalidState("the TrustList is open for writing")
            # Part 12: readers see the applied list, not one pending in a transaction.
            file = _OpenFile(caller.user, writing=False, data=bytearray(self._state.trust_list.encode(masks)))
        self._last_handle += 1
        self._files[self._last_handle] = file
        return [ua.Variant(self._last_handle, ua.VariantType.UInt32)]

    async def read(self, caller: Caller, handle: int, length: int) -> list[ua.Variant]:
        file = self._file(caller, handle)
        if file.writing:
            raise uaerrors.BadInvalidState("the file is open for writing")
        if length < 0:
            raise uaerrors.BadInvalidArgument("negative length")
        chunk = bytes(file.data[file.position : file.position + length])
        file.position += len(chunk)
        return [ua.Variant(chunk, ua.VariantType.ByteString)]

    async def write(self, caller: Caller, handle: int, data: bytes | None) -> list[ua.Variant]:
        file = self._file(caller, handle)
        if not file.writing:
            raise uaerrors.BadInvalidState("the file is open for reading")
        data = data or b""
        end = file.position + len(data)
        limit = self._config.max_trust_list_size
        if limit and max(end, len(file.data)) > limit:
            raise uaerrors.BadEncodingLimitsExceeded(f"the TrustList would exceed MaxTrustListSize {limit}")
        file.data[file.position : end] = data
        file.position = end
        return []

    async def get_position(self, caller: Caller, handle: int) -> list[ua.Variant]:
        return [ua.Variant(self._file(caller, handle).position, ua.VariantType.UInt64)]

    async def set_position(self, caller: Caller, handle: int, position: int) -> list[ua.Variant]:
        file = self._file(caller, handle)
        file.position = min(position, len(file.data))
        return []

    async def close(self, caller: Caller, handle: int) -> list[ua.Variant]:
        self._file(caller, handle)
        del self._files[handle]
        return []

    async def close_and_update(self, caller: Caller, handle: int) -> list[ua.Variant]:
        file = self._file(caller, handle)
        if not file.writing:
            raise uaerrors.BadInvalidState("the file is open for reading")
        # Part 12: the file is closed and its data discarded even when it cannot be applied.
        del self._files[handle]
        update = _decode_trust_list_file(bytes(file.data))
        if self._config.trust_list_applies_at_once:
            # Like UA-.NETStandard (Opc.Ua.Server/Configuration/TrustList.cs) and node-opcua
            # (node-opcua-server-configuration, trust_list_server.ts): the stores are written at once.
            self._refuse_foreign_transaction(caller)
            applied = self._state.trust_list.updated(update)
            _validate_trust_list(applied)
            self._check_size(applied)
            await self._set_trust_list(applied)
            return [ua.Variant(False, ua.VariantType.Boolean)]
        transaction = self._join_transaction(caller)
        new = (transaction.trust_list or self._state.trust_list).updated(update)
        _validate_trust_list(new)
        self._check_size(new)
        transaction.trust_list = new
        return [ua.Variant(True, ua.VariantType.Boolean)]

    async def add_certificate(self, caller: Caller, certificate: bytes | None, is_trusted: bool) -> list[ua.Variant]:
        self._refuse_immediate_change()
        if not is_trusted:
            # Part 12 1.05: CA certificates come with their CRLs, through Write, never through AddCertificate.
            raise uaerrors.BadCertificateInvalid("AddCertificate only adds trusted certificates")
        try:
            new = x509.load_der_x509_certificate(certificate or b"")
        except ValueError as error:
            raise uaerrors.BadCertificateInvalid(str(error)) from error
        trust_list = self._state.trust_list
        if not is_self_signed(new):
            known = [x509.load_der_x509_certificate(der) for der in trust_list.certificates_der()]
            if not any(issued_by(new, ca) for ca in known):
                raise uaerrors.BadCertificateChainIncomplete("the issuer is not in the trust list")
        der = der_of(new)
        if der not in trust_list.trusted_certificates:
            trust_list = replace(trust_list, trusted_certificates=(*trust_list.trusted_certificates, der))
            self._check_size(trust_list)
            await self._set_trust_list(trust_list)
        return []

    async def remove_certificate(
        self, caller: Caller, thumbprint_hex: str | None, is_trusted: bool
    ) -> list[ua.Variant]:
        self._refuse_immediate_change()
        trust_list = self._state.trust_list
        certificates, crls = (
            ("trusted_certificates", "trusted_crls") if is_trusted else ("issuer_certificates", "issuer_crls")
        )
        wanted = (thumbprint_hex or "").strip().upper()
        removed = [der for der in getattr(trust_list, certificates) if thumbprint(der) == wanted]
        if not removed:
            raise uaerrors.BadInvalidArgument(f"no certificate with thumbprint {thumbprint_hex!r}")
        removed_certificates = [x509.load_der_x509_certificate(der) for der in removed]
        # A CA leaves together with the CRLs it issued.
        kept_crls = tuple(
            der
            for der in getattr(trust_list, crls)
            if not issuing_crl(x509.load_der_x509_crl(der), removed_certificates)
        )
        kept = tuple(der for der in getattr(trust_list, certificates) if der not in removed)
        await self._set_trust_list(replace(trust_list, **{certificates: kept, crls: kept_crls}))
        return []

    def _file(self, caller: Caller, handle: int) -> _OpenFile:
        file = self._files.get(handle)
        if file is None or file.owner is not caller.user:
            raise uaerrors.BadInvalidArgument(f"invalid file handle {handle}")
        return file

    def _check_size(self, trust_list: TrustList) -> None:
        limit = self._config.max_trust_list_size
        if limit and len(trust_list.encode()) > limit:
            raise uaerrors.BadRequestTooLarge(f"the TrustList would exceed MaxTrustListSize {limit}")

    def _refuse_immediate_change(self) -> None:
        # AddCertificate and RemoveCertificate act at once, so they wait for any transaction and open file.
        if self._transaction is not None:
            raise uaerrors.BadTransactionPending()
        if self._files:
            raise uaerrors.BadInvalidState("the TrustList is open")

    # Transactions

    def _trust_list_for(self, caller: Caller) -> TrustList:
        transaction = self._transaction
        if transaction is not None and transaction.owner is caller.user and transaction.trust_list is not None:
            return transaction.trust_list
        return self._state.trust_list

    def _refuse_foreign_transaction(self, caller: Caller) -> None:
        self._adopt_abandoned(caller)
        if self._transaction is not None and self._transaction.owner is not caller.user:
            raise uaerrors.BadTransactionPending()

    def _adopt_abandoned(self, caller: Caller) -> None:
        """A transaction kept after its session closed (``keeps_abandoned_changes``) is anyone's to go on with."""
        if self._transaction is not None and self._transaction.owner is None:
            self._transaction.owner = caller.user

    def _join_transaction(self, caller: Caller) -> _Transaction:
        self._refuse_foreign_transaction(caller)
        if self._transaction is None:
            self._transaction = _Transaction(caller.user)
        return self._transaction

    def _own_transaction(self, caller: Caller) -> _Transaction:
        self._adopt_abandoned(caller)
        if self._transaction is None and self._config.keeps_abandoned_changes and self._csr_key is not None:
            self._transaction = _Transaction(caller.user)  # the abandoned key is a change ApplyChanges takes in
        if self._transaction is None:
            raise uaerrors.BadNothingToDo("no transaction is active")
        if self._transaction.owner is not caller.user:
            raise uaerrors.BadSessionIdInvalid("the transaction belongs to another session")
        return self._transaction

    def _end_transaction(self, transaction: _Transaction) -> None:
        """Discard ``transaction``, presenting a certificate applied at once during it."""
        self._transaction = None
        if transaction.present_certificate:
            self._on_applied()

    def session_closed(self, user: Any) -> None:
        """Part 12: a closed session's transaction is discarded, and so are its open files (a device that
        ``keeps_abandoned_changes`` keeps the transaction, for whoever comes next)."""
        if self._transaction is not None and self._transaction.owner is user and self._config.keeps_abandoned_changes:
            self._transaction.owner = None
        elif self._transaction is not None and self._transaction.owner is user:
            _logger.info("%s session of %s closed: pending changes discarded", self._label, getattr(user, "name", None))
            self._end_transaction(self._transaction)
        self._files = {handle: file for handle, file in self._files.items() if file.owner is not user}

    def discard_pending(self) -> None:
        """Forget everything not applied, as a device losing power does."""
        self._transaction = None
        self._csr_key = None
        self._files.clear()

    # Client application certificates

    async def validate_client_certificate(
        self, certificate: x509.Certificate, description: ua.ApplicationDescription
    ) -> None:
        """asyncua's certificate validator: raise the Part 4 status refusing a client, listing it as rejected."""
        trust_list = self._state.trust_list
        if not (self._config.auto_accept and trust_list.is_empty()):
            status = verify_client_certificate(certificate, trust_list)
            if status is not None:
                self._reject(der_of(certificate))
                _logger.info(
                    "%s client %s refused: %s",
                    self._label,
                    certificate.subject.rfc4514_string(),
                    ua.StatusCode(status).name,
                )
                raise uaerrors.UaStatusCodeError(status)
        if description.ApplicationUri not in application_uris(certificate):
            raise uaerrors.BadCertificateUriInvalid()

    def _reject(self, der: bytes) -> None:
        if der in self._state.rejected:
            return
        self._state.rejected = (*self._state.rejected, der)[-self._config.max_rejected :]
        self._store.save_rejected(self._state.rejected)

    # Address space

    async def _set_trust_list(self, trust_list: TrustList) -> None:
        self.trust_list_changes += 1
        self._state.trust_list = trust_list
        self._state.trust_list_updated = datetime.now(UTC)
        self._store.save_trust_list(trust_list)
        await self._publish_trust_list_properties()

    async def _publish_trust_list_properties(self) -> None:
        ids = ua.ObjectIds
        await self._write(
            getattr(ids, f"{_TRUST_LIST_IDS}_Size"), len(self._state.trust_list.encode()), ua.VariantType.UInt64
        )
        await self._write(
            getattr(ids, f"{_TRUST_LIST_IDS}_LastUpdateTime"), self._state.trust_list_updated, ua.VariantType.DateTime
        )

    def _open_count(self, node_id: ua.NodeId, attribute: ua.AttributeIds) -> ua.DataValue:
        return ua.DataValue(ua.Variant(len(self._files), ua.VariantType.UInt16))

    async def _write(self, node_id: int, value: Any, variant_type: ua.VariantType | None = None) -> None:
        node = self._server.get_node(self._node_id(ua.NodeId(node_id)))
        await node.write_value(ua.Variant(value, variant_type))

    def _node_id(self, well_known: ua.NodeId) -> ua.NodeId:
        """The NodeId this device gives the node ``well_known`` names (``SimulatorConfig.node_generation``)."""
        return self._node_ids.get(well_known, well_known)

    async def _hide_unsupported_certificate_groups(self) -> None:
        # Like the OPC Foundation's reference server, a device lists only the groups it manages. Unlinking
        # them is enough: deleting nodes makes asyncua visit every node of the address space.
        groups = self._server.get_node(ua.NodeId(ua.ObjectIds.ServerConfiguration_CertificateGroups))
        for group in (
            ua.ObjectIds.ServerConfiguration_CertificateGroups_DefaultHttpsGroup,
            ua.ObjectIds.ServerConfiguration_CertificateGroups_DefaultUserTokenGroup,
        ):
            await groups.delete_reference(ua.NodeId(group), ua.ObjectIds.HasComponent)

    async def _add_get_certificates(self) -> None:
        # Part 12 1.05 GetCertificates: asyncua's nodeset has it on ServerConfigurationType only.
        definition = self._server.get_node(ua.NodeId(ua.ObjectIds.ServerConfigurationType_GetCertificates))
        inputs = await definition.get_child("0:InputArguments")
        outputs = await definition.get_child("0:OutputArguments")
        await self._server.get_node(_SERVER_CONFIGURATION).add_method(
            ua.NodeId(ua.ObjectIds.ServerConfiguration_GetCertificates),
            ua.QualifiedName("GetCertificates", 0),
            None,
            await inputs.read_value(),
            await outputs.read_value(),
        )


_DROP_STEPS_BY_METHOD = {
    "CreateSigningRequest": "create_signing_request",
    "UpdateCertificate": "update_certificate",
    "ApplyChanges": "apply_changes",
    "Write": "write",
    "CloseAndUpdate": "close_and_update",
}


def _drop_step(method: str, values: list[Any]) -> str | None:
    """The ``DROP_STEPS`` entry a call is, before it runs (``applied`` comes after ApplyChanges ran)."""
    if method == "Open":
        return "open" if isinstance(values[0], int) and values[0] & ua.OpenFileMode.Write else None
    return _DROP_STEPS_BY_METHOD.get(method)


def _authorize(caller: Caller | None) -> None:
    if caller is None or caller.mode != ua.MessageSecurityMode.SignAndEncrypt:
        raise uaerrors.BadSecurityModeInsufficient()
    if not getattr(caller.user, "security_admin", False):
        raise uaerrors.BadUserAccessDenied()


def _check_group_and_type(group_id: ua.NodeId | None, type_id: ua.NodeId | None) -> None:
    # Part 12: a null group means the DefaultApplicationGroup, a null type the group's (only) type.
    if group_id is not None and not group_id.is_null() and group_id != DEFAULT_APPLICATION_GROUP:
        raise uaerrors.BadInvalidArgument(f"unknown certificate group {group_id.to_string()}")
    if type_id is not None and not type_id.is_null() and type_id != CERTIFICATE_TYPE:
        raise uaerrors.BadInvalidArgument(f"unsupported certificate type {type_id.to_string()}")


async def _input_arguments(method: Node) -> list[ua.Argument]:
    for child in await method.get_properties():
        if (await child.read_browse_name()).Name == "InputArguments":
            return await child.read_value()
    return []


def _argument_mismatch(expected: Sequence[ua.Argument], given: Sequence[ua.Variant]) -> ua.CallMethodResult | None:
    """The Call result refusing arguments of the wrong number or type (Part 4 5.11.2), or None."""
    if len(given) != len(expected):
        status = (
            ua.StatusCodes.BadArgumentsMissing if len(given) < len(expected) else ua.StatusCodes.BadTooManyArguments
        )
        return ua.CallMethodResult(StatusCode=ua.StatusCode(status))
    results = [
        ua.StatusCode() if _matches(argument, variant) else ua.StatusCode(ua.StatusCodes.BadTypeMismatch)
        for argument, variant in zip(expected, given, strict=True)
    ]
    if all(result.is_good() for result in results):
        return None
    return ua.CallMethodResult(
        StatusCode=ua.StatusCode(ua.StatusCodes.BadInvalidArgument), InputArgumentResults=results
    )


def _matches(argument: ua.Argument, variant: ua.Variant) -> bool:
    expected = ua.VariantType(argument.DataType.Identifier)
    is_array = argument.ValueRank >= 0
    if variant.VariantType == ua.VariantType.Null:
        # An empty Variant stands for a null array, string, byte string or NodeId; numbers have no null.
        return is_array or expected in (ua.VariantType.String, ua.VariantType.ByteString, ua.VariantType.NodeId)
    return variant.VariantType == expected and variant.is_array == is_array


def _decode_trust_list_file(data: bytes) -> ua.TrustListDataType:
    """The TrustListDataType of an uploaded file: a bare UA Binary body, nothing around or after it."""
    buffer = Buffer(data)
    try:
        decoded = ua.ua_binary.struct_from_binary(ua.TrustListDataType, buffer)
    except Exception as error:  # whatever asyncua's decoder trips over, the file is malformed
        raise uaerrors.BadDecodingError(f"not a TrustListDataType: {error}") from error
    if len(buffer) or decoded.SpecifiedLists & ~ua.TrustListMasks.All:
        raise uaerrors.BadDecodingError("not a bare TrustListDataType")
    return decoded


def _validate_trust_list(trust_list: TrustList) -> None:
    try:
        certificates = [x509.load_der_x509_certificate(der) for der in trust_list.certificates_der()]
        crls = trust_list.crls()
    except ValueError as error:
        raise uaerrors.BadCertificateInvalid(f"the TrustList holds something that is not DER: {error}") from error
    for crl in crls:
        if not issuing_crl(crl, certificates):
            raise uaerrors.BadCertificateInvalid(
                f"no CA in the TrustList issued the CRL of {crl.issuer.rfc4514_string()}"
            )
