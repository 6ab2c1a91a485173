"""A device's ServerConfiguration object (OPC UA Part 12): its DefaultApplicationGroup, the push management methods
and the properties that describe what the device can do, as the push flow and the driver's reads use them.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

from asyncua import ua
from cryptography import x509
from cryptography.x509.oid import NameOID

from certlm import Enrollment, to_der
from certlm_gds_push.connection import DeviceError, DeviceSession, status_name
from certlm_gds_push.trust_list import TrustListFile

log = logging.getLogger(__name__)

DEFAULT_APPLICATION_GROUP = ua.NodeId(ua.ObjectIds.ServerConfiguration_CertificateGroups_DefaultApplicationGroup)
RSA_SHA256_APPLICATION_CERTIFICATE_TYPE = ua.NodeId(ua.ObjectIds.RsaSha256ApplicationCertificateType)


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
        # DefaultApplicationGroup's CertificateTypes, and its TrustList with its methods, where ``locate`` found them.
        self.group_types_id: ua.NodeId | None = None
        self.trust_list_nodes: list[ua.NodeId | None] | None = None
        self.nodes = {
            name: ua.NodeId(getattr(ua.ObjectIds, f"ServerConfiguration_{name}"))
            for name in self.METHODS + self.PROPERTIES
        }

    @classmethod
    async def locate(cls, session: DeviceSession, assume_standard: bool = False) -> ServerConfiguration:
        """Resolve every node the push flow uses, DefaultApplicationGroup's CertificateTypes and its TrustList with
        its methods among them, in one TranslateBrowsePathsToNodeIds request, once per device (``DeviceSession.locate``
        keeps them across sessions and finds them again where the device's nodes moved): the group's browse path, not
        its NodeId, is their start (the same node; a device resolves the paths of one request independently).
        ``trust_list_file`` makes the TrustList of what was found. ``assume_standard``: for a device whose nodes were
        not found yet, Part 12's ns=0 NodeIds instead of the request, found by it only where the device answers one
        as unknown (a monitor visit's reads; not for what tells whether the device has push management at all)."""
        own, paths = _OWN_PATHS
        found = await session.locate(
            "server_configuration", _SERVER, paths, _STANDARD_NODES if assume_standard else None
        )
        configuration = cls(session)
        configuration._set_found(found[:own])
        configuration.trust_list_nodes = list(found[own:])
        return configuration

    @classmethod
    async def locate_with_trust_list(
        cls, session: DeviceSession, assume_standard: bool = False
    ) -> tuple[ServerConfiguration, TrustListFile]:
        """``locate`` and DefaultApplicationGroup's ``TrustListFile``."""
        configuration = await cls.locate(session, assume_standard)
        return configuration, await configuration.trust_list_file()

    async def trust_list_file(self) -> TrustListFile:
        """DefaultApplicationGroup's TrustList from the nodes ``locate`` found, else looked up now (raises
        ``DeviceError`` where the device has none)."""
        if self.trust_list_nodes is None:
            return await TrustListFile.locate(self.session, self.group_id)
        return TrustListFile.from_found(self.session, self.group_id, self.trust_list_nodes)

    @classmethod
    def _browse_paths(cls) -> tuple[int, tuple[tuple[str, ...], ...]]:
        """From the Server object: ServerConfiguration, its CertificateGroups, DefaultApplicationGroup, each of
        ``METHODS`` and ``PROPERTIES``, then DefaultApplicationGroup's CertificateTypes (how many: the first number);
        then DefaultApplicationGroup's TrustList with its methods (``TrustListFile.browse_paths``)."""
        group = ("0:ServerConfiguration", "0:CertificateGroups", "0:DefaultApplicationGroup")
        own = (
            ("0:ServerConfiguration",),
            ("0:ServerConfiguration", "0:CertificateGroups"),
            group,
            *(("0:ServerConfiguration", f"0:{name}") for name in cls.METHODS + cls.PROPERTIES),
            (*group, "0:CertificateTypes"),
        )
        return len(own), own + tuple(tuple(path) for path in TrustListFile.browse_paths(group))

    def _set_found(self, found: Sequence[ua.NodeId | None]) -> None:
        configuration, names = self, self.METHODS + self.PROPERTIES
        configuration.present = found[0] is not None
        configuration.node_id = found[0] or configuration.node_id
        configuration.groups_id = found[1] or configuration.groups_id
        configuration.group_id = found[2] or configuration.group_id
        by_name = zip(names, found[3 : 3 + len(names)], strict=True)
        configuration.nodes |= {name: node_id for name, node_id in by_name if node_id}
        configuration.group_types_id = found[3 + len(names)] if found[2] is not None else None

    async def capabilities(self, also_read: Sequence[ua.NodeId] = ()) -> tuple[dict[str, Any], list[Any]]:
        """SupportedPrivateKeyFormats, MaxTrustListSize, ServerCapabilities and the certificate groups with their
        CertificateTypes, as JSON data (``{"push_management": False}`` when the device has no ServerConfiguration);
        and the values of ``also_read``, read in the same request (``DeviceSession.read_values``). Every request is
        one round trip, each encrypted and signed both ways: the properties, DefaultApplicationGroup's types (found by
        ``locate``) and ``also_read`` go in one Read, and only another group's types need a Translate and a Read."""
        if not self.present:
            return {"push_management": False}, await self.session.read_values(list(also_read))
        own = [self.nodes[name] for name in self.PROPERTIES]
        if self.group_types_id is not None:
            own.append(self.group_types_id)
        values = await self.session.read_values([*own, *also_read])
        key_formats, max_size, server_capabilities = values[: len(self.PROPERTIES)]
        types_by_group: dict[ua.NodeId, Any] = {}
        if self.group_types_id is not None:
            types_by_group[self.group_id] = values[len(self.PROPERTIES)]
        groups = await self.session.children(self.groups_id)
        others = [group for group in groups if group.NodeId not in types_by_group]
        type_nodes = await self.session.translate(
            self.groups_id,
            *([f"{group.BrowseName.NamespaceIndex}:{group.BrowseName.Name}", "0:CertificateTypes"] for group in others),
        )
        present = [node for node in type_nodes if node is not None]
        types_by_node = dict(zip(present, await self.session.read_values(present), strict=True))
        for group, node in zip(others, type_nodes, strict=True):
            types_by_group[group.NodeId] = types_by_node.get(node)
        return {
            "push_management": True,
            "supported_private_key_formats": list(key_formats or []),
            "max_trust_list_size": int(max_size or 0),
            "server_capabilities": list(server_capabilities or []),
            "certificate_groups": [
                {
                    "name": group.BrowseName.Name,
                    "node_id": group.NodeId.to_string(),
                    "certificate_types": [type_name(t) for t in types_by_group.get(group.NodeId) or []],
                }
                for group in groups
            ],
        }, values[len(own) :]

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

    async def apply_changes(self) -> None:
        await self._call("ApplyChanges")

    async def cancel_changes(self) -> bool:
        """Discard pending changes, best effort; whether the device said it discarded them (or had none). A device
        without CancelChanges (node-opcua 2.157) may keep them across sessions and take them in at its next
        ApplyChanges, whoever calls it."""
        url = self.session.client.server_url.geturl()
        try:
            await asyncio.wait_for(self._call("CancelChanges"), self.session.timeouts.connect_s)
        except ua.UaStatusCodeError as error:
            status = status_name(error)
            if status == "BadNothingToDo":
                return True
            if status not in {"BadMethodInvalid", "BadNotImplemented", "BadNotSupported"}:
                log.warning("CancelChanges on %s: %s", url, status)
            return False
        except Exception as error:
            log.info("CancelChanges on %s: %s", url, status_name(error))
            return False
        return True


_SERVER = ua.NodeId(ua.ObjectIds.Server)
_OWN_PATHS = ServerConfiguration._browse_paths()  # built once: ``DeviceSession.locate`` compares them
# Where Part 12 puts the node at each of those paths: its ns=0 NodeId is named by the path's browse names.
_STANDARD_NODES = tuple(
    ua.NodeId(getattr(ua.ObjectIds, "_".join(name.removeprefix("0:") for name in path))) for path in _OWN_PATHS[1]
)


def type_name(node_id: ua.NodeId) -> str:
    """A certificate type as capabilities show it: its ns=0 name, else the NodeId string."""
    if node_id.NamespaceIndex == 0 and node_id.Identifier in ua.ObjectIdNames:
        return ua.ObjectIdNames[node_id.Identifier]
    return node_id.to_string()


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
