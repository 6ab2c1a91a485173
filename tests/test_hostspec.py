"""The three spellings of ``{host_or_url}``, what is refused, and the URLs of device addresses."""

from __future__ import annotations

import re

import pytest

from certlm.foundation.errors import APIError
from certlm.foundation.hostspec import HostSpec, address_url, parse_host_or_url

# What the GDS routes accept with the GDS push plugin installed.
OPC_UA = ("opc.tcp",)


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
    assert parse_host_or_url(text, OPC_UA) == expected


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
        parse_host_or_url(text, OPC_UA)
    assert error.value.status == 400


def test_every_installed_scheme_is_accepted_and_named_when_refusing() -> None:
    schemes = ("opc.tcp", "ssh")
    assert parse_host_or_url("ssh://gateway-3:2222", schemes) == HostSpec("gateway-3", 2222)
    assert parse_host_or_url("opc.tcp://gateway-3", schemes) == HostSpec("gateway-3", None)
    with pytest.raises(APIError, match=re.escape("only opc.tcp:// or ssh:// URLs are accepted")):
        parse_host_or_url("https://gateway-3:443", schemes)
    with pytest.raises(APIError, match=re.escape("is not host, host:port or opc.tcp://host:port or ssh://host:port")):
        parse_host_or_url("gate way", schemes)


def test_without_installed_drivers_only_addresses_are_accepted() -> None:
    assert parse_host_or_url("plc-7:4840", ()) == HostSpec("plc-7", 4840)
    with pytest.raises(APIError, match="no installed device driver takes URLs, give host:port"):
        parse_host_or_url("opc.tcp://plc-7:4840", ())
    with pytest.raises(APIError, match=r"'pl c' is not host, host:port$"):
        parse_host_or_url("pl c", ())


def test_address_urls() -> None:
    assert address_url("opc.tcp", "plc-7", 4840) == "opc.tcp://plc-7:4840"
    assert address_url("opc.tcp", "::1", 4841) == "opc.tcp://[::1]:4841"
    assert address_url("ssh", "192.0.2.7", 22) == "ssh://192.0.2.7:22"
    # No installed driver manages the device: its address, with no scheme that would claim a protocol.
    assert address_url(None, "fe80::1", 22) == "[fe80::1]:22"
