"""The gds_push plugin's decoder of endpoint lists (``certlm_gds_push.connection._RememberedEndpoints``): a list of
EndpointDescription whose bytes were decoded before is not decoded again (a monitor visit decodes its device's
endpoints twice, GetEndpoints' and CreateSession's, and every scan the same bytes again), and what follows it in the
message is decoded as ever; a list that changed is decoded anew."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from asyncua import ua
from asyncua.common.utils import Buffer
from asyncua.ua.ua_binary import struct_from_binary, struct_to_binary
from certlm_gds_push import connection

from certlm.lifecycle.monitoring import monitor_device
from certlm.storage.models import InventoryEntry
from certlm.testing import InProcessApp, InternalCa, push


def _session_result(certificate: bytes, signature: bytes = b"signed") -> ua.CreateSessionResult:
    endpoints = [
        ua.EndpointDescription(
            EndpointUrl="opc.tcp://plc-7:4840",
            ServerCertificate=certificate,
            SecurityMode=mode,
            SecurityPolicyUri="http://opcfoundation.org/UA/SecurityPolicy#Basic256Sha256",
        )
        for mode in (ua.MessageSecurityMode.Sign, ua.MessageSecurityMode.SignAndEncrypt)
    ]
    return ua.CreateSessionResult(
        ServerEndpoints=endpoints,
        ServerCertificate=certificate,
        ServerSignature=ua.SignatureData(Signature=signature),
        MaxRequestMessageSize=65536,
    )


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many endpoint lists were decoded (not found remembered), from now on."""
    remembered = connection._decoder_of_list_remembering_endpoints(ua.EndpointDescription)
    assert isinstance(remembered, connection._RememberedEndpoints)
    counted: list[int] = []
    decode = remembered._decode

    def counting(data: Any) -> list[Any]:
        counted.append(1)
        return decode(data)

    monkeypatch.setattr(remembered, "_decode", counting)
    return counted


def test_a_list_decoded_before_is_not_decoded_again_and_what_follows_it_is(decodes: list[int]) -> None:
    first = _session_result(b"certificate-1", b"first")
    again = _session_result(b"certificate-1", b"again")
    changed = _session_result(b"certificate-2", b"changed")
    read = [struct_from_binary(ua.CreateSessionResult, Buffer(struct_to_binary(r))) for r in (first, again, changed)]
    assert read == [first, again, changed]
    assert len(decodes) == 2, "the second list, the same bytes as the first, was decoded again"
    # Each message has lists of its own, with the same objects where the bytes were the same.
    assert read[0].ServerEndpoints is not read[1].ServerEndpoints
    assert read[2].ServerEndpoints[0].ServerCertificate == b"certificate-2"


async def test_a_monitor_visit_decodes_no_endpoint_list_its_device_announced_before(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa, certlm_simulated_device: Any, decodes: list[int]
) -> None:
    device = await certlm_simulated_device()
    await push(certlm_in_process, device)
    async with certlm_in_process.context():
        entry = await InventoryEntry.get(port=device.config.port)
        assert await monitor_device(certlm_in_process.host.runtime, entry, datetime.now(UTC)) == "read"
        decodes.clear()
        assert await monitor_device(certlm_in_process.host.runtime, entry, datetime.now(UTC)) == "read"
    # Before: two a visit, GetEndpoints' answer and CreateSession's.
    assert decodes == []
