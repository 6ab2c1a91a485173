"""The three spellings of ``{host_or_url}`` and what is refused."""

from __future__ import annotations

import pytest

from certlm.errors import APIError
from certlm.hostspec import HostSpec, parse_host_or_url


@pytest.mark.parametrize(
    "text, expected",
    [
        ("plc-7.plant.local", HostSpec("plc-7.plant.local", None)),
        ("192.0.2.10", HostSpec("192.0.2.10", None)),
        ("192.0.2.10:4841", HostSpec("192.0.2.10", 4841)),
        ("opc.tcp://192.0.2.10:4840", HostSpec("192.0.2.10", 4840)),
        ("opc.tcp%3A%2F%2Fplc-7%3A48010", HostSpec("plc-7", 48010)),
        ("OPC.TCP://plc-7:4840/", HostSpec("plc-7", 4840)),
        ("opc.tcp://plc-7", HostSpec("plc-7", None)),
        ("[::1]:4840", HostSpec("::1", 4840)),
        ("opc.tcp://[fe80::1]:4840", HostSpec("fe80::1", 4840)),
        ("fe80::1", HostSpec("fe80::1", None)),
    ],
)
def test_accepted_spellings(text: str, expected: HostSpec) -> None:
    assert parse_host_or_url(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("plc:0", "port must be an integer from 1 to 65535"),
        ("plc:65536", "port must be an integer from 1 to 65535"),
        ("plc:abc", "port must be an integer from 1 to 65535"),
        ("http://plc:80", "only opc.tcp:// URLs are accepted"),
        ("pl c", "is not host, host:port or opc.tcp://host:port"),
        ("", "is not host, host:port or opc.tcp://host:port"),
        ("plc;rm -rf", "is not host, host:port or opc.tcp://host:port"),
        ("[::1]x", "is not host, host:port or opc.tcp://host:port"),
        ("[::1", "is not host, host:port or opc.tcp://host:port"),
        ("a:b:c", "is not host, host:port or opc.tcp://host:port"),
        ("[fe80::zz]:4840", "is not host, host:port or opc.tcp://host:port"),
    ],
)
def test_refused_spellings(text: str, message: str) -> None:
    with pytest.raises(APIError, match=message) as error:
        parse_host_or_url(text)
    assert error.value.status == 400


def test_url_of_a_bare_host_uses_the_default_port() -> None:
    assert parse_host_or_url("plc-7").url == "opc.tcp://plc-7:4840"
    assert parse_host_or_url("[::1]:4841").url == "opc.tcp://[::1]:4841"
