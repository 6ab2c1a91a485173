"""PBMAC1 (RFC 9481 §6.1.2). OpenSSL 3.0's CMP server has no PBMAC1, so a relay in front of the mock re-protects
its answers with PBMAC1 and checks certlm's PBMAC1 requests, both computed here independently with hashlib."""

from __future__ import annotations

import hashlib
import hmac
import os

import pytest
from pyasn1.codec.der import decoder, encoder
from pyasn1.type import univ
from pyasn1_alt_modules import rfc8018, rfc9480

from certlm import SERVER_PROFILE, UpstreamUnavailable
from tests.crypto_factory import device_csr, ec_key
from tests.plugins.pki_cmp.cmp_server import forward_to
from tests.plugins.pki_cmp.conftest import MAC_SERVER, SECRET, decoded, mac_entry, received

HMAC_SHA256 = univ.ObjectIdentifier("1.2.840.113549.2.9")
ITERATIONS = 2048


def protected_part(message: rfc9480.PKIMessage) -> bytes:
    part = rfc9480.ProtectedPart()
    part["header"] = message["header"]
    part["body"] = message["body"]
    return encoder.encode(part)


def with_protection(message: rfc9480.PKIMessage, protection: bytes) -> bytes:
    schema = message.componentType.getTypeByPosition(message.componentType.getPositionByName("protection"))
    message["protection"] = schema.clone(hexValue=protection.hex())
    return encoder.encode(message)


def pbmac1_key(salt: bytes, iterations: int) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", SECRET.encode(), salt, iterations, 32)


def reprotect_with_pbmac1(answer: bytes) -> bytes:
    message = decoded(answer)
    salt = os.urandom(16)
    kdf = rfc8018.PBKDF2_params()
    kdf["salt"]["specified"] = salt
    kdf["iterationCount"] = ITERATIONS
    kdf["keyLength"] = 32
    kdf["prf"]["algorithm"] = HMAC_SHA256
    parameters = rfc8018.PBMAC1_params()
    parameters["keyDerivationFunc"]["algorithm"] = rfc8018.id_PBKDF2
    parameters["keyDerivationFunc"]["parameters"] = encoder.encode(kdf)
    parameters["messageAuthScheme"]["algorithm"] = HMAC_SHA256
    algorithm = message["header"]["protectionAlg"]
    algorithm["algorithm"] = rfc8018.id_PBMAC1
    algorithm["parameters"] = encoder.encode(parameters)
    tag = hmac.new(pbmac1_key(salt, ITERATIONS), protected_part(message), "sha256").digest()
    return with_protection(message, tag)


def pbmac1_verifies(request: bytes) -> bool:
    message = decoded(request)
    algorithm = message["header"]["protectionAlg"]
    if algorithm["algorithm"] != rfc8018.id_PBMAC1:
        return False
    parameters, _ = decoder.decode(bytes(algorithm["parameters"]), asn1Spec=rfc8018.PBMAC1_params())
    kdf, _ = decoder.decode(bytes(parameters["keyDerivationFunc"]["parameters"]), asn1Spec=rfc8018.PBKDF2_params())
    assert parameters["messageAuthScheme"]["algorithm"] == HMAC_SHA256
    assert kdf["prf"]["algorithm"] == HMAC_SHA256 and int(kdf["keyLength"]) == 32
    key = pbmac1_key(bytes(kdf["salt"]["specified"]), int(kdf["iterationCount"]))
    expected = hmac.new(key, protected_part(message), "sha256").digest()
    return hmac.compare_digest(expected, message["protection"].asOctets())


async def test_pbmac1_answer_switches_the_transaction_to_pbmac1(cmp_app, test_pki, start_mock, start_relay) -> None:
    key = ec_key()
    issued = test_pki.issue(key.public_key(), "device-30")
    # The mock cannot check PBMAC1: the relay does, so the mock lets the certConf through unchecked.
    server = start_mock(*MAC_SERVER, *test_pki.answering(issued), "-accept_unprotected")
    forward = forward_to(server)

    async def relay_handler(request: bytes) -> tuple[bytes, str]:
        answer, content_type = await forward(request)
        return reprotect_with_pbmac1(answer), content_type

    relay = await start_relay(relay_handler)
    entry = await mac_entry(cmp_app, relay)

    enrollment = await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)

    assert enrollment.certificate == issued
    assert received(server) == ["P10CR", "CERTCONF", "GENM"]
    # Then genm, a transaction of its own: no CA certificate came with the certificate.
    first, confirmation, _ = relay.requests
    # The transaction starts with PasswordBasedMac and continues with PBMAC1 after the server used it.
    assert decoded(first)["header"]["protectionAlg"]["algorithm"] == rfc9480.id_PasswordBasedMac
    assert pbmac1_verifies(confirmation)


async def test_pbmac1_with_another_secret_is_rejected(cmp_app, start_mac_mock, start_relay) -> None:
    key = ec_key()
    server = start_mac_mock(key)
    forward = forward_to(server)

    async def relay_handler(request: bytes) -> tuple[bytes, str]:
        answer, content_type = await forward(request)
        return with_protection(decoded(reprotect_with_pbmac1(answer)), bytes(32)), content_type

    relay = await start_relay(relay_handler)
    entry = await mac_entry(cmp_app, relay)
    with pytest.raises(UpstreamUnavailable, match="does not verify with the password"):
        await cmp_app.backend.enroll(entry, device_csr(key), SERVER_PROFILE)
    assert received(server) == ["P10CR"]
