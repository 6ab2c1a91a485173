"""Reading and writing a certificate group's TrustList file object (OPC UA Part 12 TrustListType), for the push and
for ``GdsPushDriver.write_trust_list``.

The file holds one UA Binary encoded ``TrustListDataType``, not wrapped in an ExtensionObject. asyncua's ``UaFile``
has neither OpenWithMasks nor CloseAndUpdate (and relies on the Size property, which a TrustList need not serve), so
the file methods are called here directly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from asyncua import ua
from asyncua.common.utils import Buffer
from asyncua.ua.ua_binary import struct_from_binary, struct_to_binary

from certlm import TrustList
from certlm_gds_push.connection import DeviceError, DeviceSession, status_name

# Well-known ns=0 NodeIds of DefaultApplicationGroup's TrustList and its methods, for a device whose address space
# does not resolve the browse path to them.
_DEFAULT_APPLICATION_GROUP = ua.NodeId(ua.ObjectIds.ServerConfiguration_CertificateGroups_DefaultApplicationGroup)
_WELL_KNOWN_PREFIX = "ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList"
_DEFAULT_APPLICATION_TRUST_LIST = ua.NodeId(getattr(ua.ObjectIds, _WELL_KNOWN_PREFIX))
_DEFAULT_APPLICATION_TRUST_LIST_METHODS = {
    name: ua.NodeId(getattr(ua.ObjectIds, f"{_WELL_KNOWN_PREFIX}_{name}"))
    for name in ("Open", "OpenWithMasks", "Read", "Write", "Close", "CloseAndUpdate")
}

# Bytes per Read/Write call: small enough for devices with small message buffers, large enough to need few calls.
CHUNK_BYTES = 32 * 1024
WRITE_ERASE_EXISTING = ua.OpenFileMode.Write | ua.OpenFileMode.EraseExisting
TRUSTED_LISTS = TrustList.MASK_BITS["trusted_certificates"] | TrustList.MASK_BITS["trusted_crls"]
ISSUER_LISTS = TrustList.MASK_BITS["issuer_certificates"] | TrustList.MASK_BITS["issuer_crls"]
# Answers to opening the TrustList for reading that mean "this session may not read it" (Part 12 lets a server keep
# its trust list from anyone but a SecurityAdmin, or from everyone), not that something went wrong.
READ_REFUSED_STATUSES = frozenset({"BadUserAccessDenied", "BadNotReadable", "BadNotSupported", "BadNotImplemented"})


def to_data_type(trust_list: TrustList, specified_lists: int) -> ua.TrustListDataType:
    """The file content for ``trust_list``; only the lists in ``specified_lists`` are set and replaced on the device."""
    masks = TrustList.MASK_BITS
    return ua.TrustListDataType(
        SpecifiedLists=specified_lists,
        TrustedCertificates=trust_list.trusted_certificates if specified_lists & masks["trusted_certificates"] else [],
        TrustedCrls=trust_list.trusted_crls if specified_lists & masks["trusted_crls"] else [],
        IssuerCertificates=trust_list.issuer_certificates if specified_lists & masks["issuer_certificates"] else [],
        IssuerCrls=trust_list.issuer_crls if specified_lists & masks["issuer_crls"] else [],
    )


def from_data_type(data: ua.TrustListDataType, mask: int) -> TrustList:
    """The lists selected by ``mask`` that the device marked as specified; the others empty."""
    selected = data.SpecifiedLists & mask
    masks = TrustList.MASK_BITS

    def part(name: str, items: list[bytes] | None) -> list[bytes]:
        return list(items or []) if selected & masks[name] else []

    return TrustList(
        trusted_certificates=part("trusted_certificates", data.TrustedCertificates),
        trusted_crls=part("trusted_crls", data.TrustedCrls),
        issuer_certificates=part("issuer_certificates", data.IssuerCertificates),
        issuer_crls=part("issuer_crls", data.IssuerCrls),
    )


def check_trust_list(trust_list: TrustList, limit: int, specified_lists: int) -> None:
    """Refuse a trust list the device cannot hold (``limit`` bytes, 0 for none), before anything is sent. Without a
    limit the list is not encoded to be measured: nothing would compare its size (twice a push)."""
    if not limit:
        return
    size = encoded_size(trust_list, specified_lists)
    if size > limit:
        raise DeviceError(
            f"trust list too large: {size} bytes, the device accepts at most {limit}", "BadRequestTooLarge"
        )


def encoded_size(trust_list: TrustList, specified_lists: int) -> int:
    """The bytes the lists of ``specified_lists`` take as the device is sent them: what its limit counts."""
    return len(encode(to_data_type(trust_list, specified_lists)))


def encode(data: ua.TrustListDataType) -> bytes:
    return struct_to_binary(data)


def decode(content: bytes) -> ua.TrustListDataType:
    return struct_from_binary(ua.TrustListDataType, Buffer(content))


@dataclass(frozen=True)
class TrustListFile:
    """A certificate group's TrustList object and its file methods, as the device names them."""

    session: DeviceSession
    node_id: ua.NodeId
    methods: dict[str, ua.NodeId]

    @classmethod
    async def locate(cls, session: DeviceSession, group_id: ua.NodeId = _DEFAULT_APPLICATION_GROUP) -> TrustListFile:
        """Browse from the certificate group to its TrustList and methods; DefaultApplicationGroup falls back to the
        well-known ns=0 NodeIds where the device does not resolve a path."""
        return cls.from_found(session, group_id, await session.translate(group_id, *cls.browse_paths()))

    @staticmethod
    def browse_paths(group_path: tuple[str, ...] = ()) -> list[list[str]]:
        """The browse paths ``locate`` resolves, below the group at ``group_path`` (for a caller that resolves them in
        a request of its own: ``ServerConfiguration.locate_with_trust_list``)."""
        trust_list = [*group_path, "0:TrustList"]
        return [trust_list, *([*trust_list, f"0:{name}"] for name in _DEFAULT_APPLICATION_TRUST_LIST_METHODS)]

    @classmethod
    def from_found(cls, session: DeviceSession, group_id: ua.NodeId, found: list[ua.NodeId | None]) -> TrustListFile:
        """The TrustList of ``group_id`` from the nodes its ``browse_paths`` resolved to (``found``, in order)."""
        names = tuple(_DEFAULT_APPLICATION_TRUST_LIST_METHODS)
        well_known = group_id == _DEFAULT_APPLICATION_GROUP
        node_id = found[0] or (_DEFAULT_APPLICATION_TRUST_LIST if well_known else None)
        if node_id is None:
            raise DeviceError(f"certificate group {group_id.to_string()} has no TrustList", "BadNodeIdUnknown")
        methods = {name: method_id for name, method_id in zip(names, found[1:], strict=True) if method_id}
        if well_known:
            methods = _DEFAULT_APPLICATION_TRUST_LIST_METHODS | methods
        return cls(session, node_id, methods)

    def _method(self, method: str) -> ua.NodeId:
        method_id = self.methods.get(method)
        if method_id is None:
            raise DeviceError(f"the device's TrustList has no {method} method", "BadMethodInvalid")
        return method_id

    async def _call(self, method: str, *arguments: ua.Variant) -> list:
        return await self.session.call(self.node_id, self._method(method), *arguments)

    async def read(self, mask: int) -> ua.TrustListDataType:
        """OpenWithMasks, then Read and Close in one Call request: a trust list of less than ``CHUNK_BYTES`` (the
        usual one) is read in two round trips, not three. A list the first Read does not hold whole, or a Read the
        device refused there, is read again as ``read_in_chunks`` reads it (a refusal then raises as it did)."""
        (handle,) = await self._call("OpenWithMasks", ua.Variant(mask, ua.VariantType.UInt32))
        handle_argument = ua.Variant(handle, ua.VariantType.UInt32)
        chunk, closed = await self.session.call_in_one(
            (self.node_id, self._method("Read"), (handle_argument, ua.Variant(CHUNK_BYTES, ua.VariantType.Int32))),
            (self.node_id, self._method("Close"), (handle_argument,)),
        )
        if isinstance(closed, ua.UaStatusCodeError):
            raise closed
        if isinstance(chunk, ua.UaStatusCodeError) or len(chunk[0] or b"") >= CHUNK_BYTES:
            return await self.read_in_chunks(mask)
        return decode(bytes(chunk[0] or b""))

    async def read_in_chunks(self, mask: int) -> ua.TrustListDataType:
        """OpenWithMasks, Read until the file ends, Close: a request each."""
        (handle,) = await self._call("OpenWithMasks", ua.Variant(mask, ua.VariantType.UInt32))
        content = bytearray()
        try:
            while True:
                (chunk,) = await self._call(
                    "Read", ua.Variant(handle, ua.VariantType.UInt32), ua.Variant(CHUNK_BYTES, ua.VariantType.Int32)
                )
                content += chunk or b""
                if not chunk or len(chunk) < CHUNK_BYTES:
                    break
        finally:
            await self._call("Close", ua.Variant(handle, ua.VariantType.UInt32))
        return decode(bytes(content))

    async def read_lists(self, mask: int) -> TrustList:
        """The lists selected by ``mask`` as the device holds them (``read``)."""
        return from_data_type(await self.read(mask), mask)

    async def read_if_allowed(self, mask: int) -> TrustList | None:
        """``read_lists``, or None when the device does not let this session read its trust list."""
        try:
            return await self.read_lists(mask)
        except ua.UaStatusCodeError as error:
            if status_name(error) in READ_REFUSED_STATUSES:
                return None
            raise

    async def write(self, data: ua.TrustListDataType) -> bool:
        """Open for Write|EraseExisting, Write in chunks, CloseAndUpdate; whether the device needs ApplyChanges.
        A failure before CloseAndUpdate closes the file with Close, which discards what was written."""
        content = encode(data)
        (handle,) = await self._call("Open", ua.Variant(WRITE_ERASE_EXISTING, ua.VariantType.Byte))
        try:
            for start in range(0, len(content), CHUNK_BYTES):
                await self._call(
                    "Write",
                    ua.Variant(handle, ua.VariantType.UInt32),
                    ua.Variant(content[start : start + CHUNK_BYTES], ua.VariantType.ByteString),
                )
        except BaseException:
            await self._discard(handle)
            raise
        outputs = await self._call("CloseAndUpdate", ua.Variant(handle, ua.VariantType.UInt32))
        return bool(outputs and outputs[0])

    async def _discard(self, handle: int) -> None:
        # The device may be gone; it discards an unclosed write with the session anyway.
        with contextlib.suppress(Exception):
            await self._call("Close", ua.Variant(handle, ua.VariantType.UInt32))
