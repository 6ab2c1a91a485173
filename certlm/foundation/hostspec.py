"""The ``{host_or_url}`` path parameter: ``host``, ``host:port`` or ``scheme://host:port`` with the URL scheme of an
installed device driver (the spec's ``opc.tcp://host:port`` for OPC UA), and the URLs of device addresses."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote

from certlm.foundation.errors import APIError
from certlm.foundation.responses import ascii_integer

# The spec's default port for an address its OPC UA routes (``/gds/...``) are given without one.
DEFAULT_OPCUA_PORT = 4840
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


@dataclass(frozen=True)
class HostSpec:
    server: str
    port: int | None  # None when the caller gave a bare host


def address_url(scheme: str | None, server: str, port: int) -> str:
    """``scheme://server:port`` (IPv6 in brackets); ``server:port`` when no scheme is known for the device."""
    host = f"[{server}]" if ":" in server else server
    return f"{scheme}://{host}:{port}" if scheme else f"{host}:{port}"


def valid_server(server: str) -> bool:
    """A hostname, IPv4 or IPv6 address (without brackets)."""
    if ":" in server:
        try:
            return isinstance(ipaddress.ip_address(server), ipaddress.IPv6Address)
        except ValueError:
            return False
    return bool(_HOSTNAME.match(server))


def _port(text: str, original: str) -> int:
    port = ascii_integer(text, 5)
    if port is None or not 1 <= port <= 65535:
        raise APIError(f"host_or_url {original[:80]!r}: port must be an integer from 1 to 65535")
    return port


def parse_host_or_url(value: str, schemes: Sequence[str]) -> HostSpec:
    """``host``, ``host:port`` or ``scheme://host:port`` with one of ``schemes`` (the installed device drivers':
    ``DeviceDriverRegistry.parse_address``); 400 naming the accepted spellings otherwise."""
    original = value
    value = unquote(value).strip()
    spellings = " or ".join(f"{scheme}://host:port" for scheme in schemes)
    malformed = f"host_or_url {original!r} is not host, host:port" + (f" or {spellings}" if spellings else "")
    if "://" in value:
        scheme, _, rest = value.partition("://")
        if scheme.lower() not in schemes:
            if not schemes:
                raise APIError(f"host_or_url {original!r}: no installed device driver takes URLs, give host:port")
            accepted = " or ".join(f"{scheme}://" for scheme in schemes)
            raise APIError(f"host_or_url {original!r}: only {accepted} URLs are accepted")
        value = rest.rstrip("/")
        if "/" in value:
            value = value.split("/", 1)[0]
    if value.startswith("["):
        host, closed, rest = value[1:].partition("]")
        if not closed:
            raise APIError(malformed)
        port = _port(rest[1:], original) if rest.startswith(":") else None
        if rest and not rest.startswith(":"):
            raise APIError(malformed)
    elif value.count(":") == 1:
        host, _, port_text = value.partition(":")
        port = _port(port_text, original)
    else:
        host, port = value, None
    if not host or not valid_server(host):
        raise APIError(malformed)
    return HostSpec(server=host, port=port)
