"""The ``{host_or_url}`` path parameter: ``host``, ``host:port`` or ``opc.tcp://host:port``."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import unquote

from certlm.errors import APIError

DEFAULT_OPCUA_PORT = 4840
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


@dataclass(frozen=True)
class HostSpec:
    server: str
    port: int | None  # None when the caller gave a bare host

    @property
    def url(self) -> str:
        return opcua_url(self.server, self.port or DEFAULT_OPCUA_PORT)


def opcua_url(server: str, port: int) -> str:
    host = f"[{server}]" if ":" in server else server
    return f"opc.tcp://{host}:{port}"


def valid_server(server: str) -> bool:
    """A hostname, IPv4 or IPv6 address (without brackets)."""
    if ":" in server:
        try:
            return isinstance(ipaddress.ip_address(server), ipaddress.IPv6Address)
        except ValueError:
            return False
    return bool(_HOSTNAME.match(server))


def _port(text: str, original: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise APIError(f"host_or_url {original!r}: port must be an integer from 1 to 65535")
    return int(text)


def parse_host_or_url(value: str) -> HostSpec:
    original = value
    value = unquote(value).strip()
    if "://" in value:
        scheme, _, rest = value.partition("://")
        if scheme.lower() != "opc.tcp":
            raise APIError(f"host_or_url {original!r}: only opc.tcp:// URLs are accepted")
        value = rest.rstrip("/")
        if "/" in value:
            value = value.split("/", 1)[0]
    if value.startswith("["):
        host, closed, rest = value[1:].partition("]")
        if not closed:
            raise APIError(f"host_or_url {original!r} is not host, host:port or opc.tcp://host:port")
        port = _port(rest[1:], original) if rest.startswith(":") else None
        if rest and not rest.startswith(":"):
            raise APIError(f"host_or_url {original!r} is not host, host:port or opc.tcp://host:port")
    elif value.count(":") == 1:
        host, _, port_text = value.partition(":")
        port = _port(port_text, original)
    else:
        host, port = value, None
    if not host or not valid_server(host):
        raise APIError(f"host_or_url {original!r} is not host, host:port or opc.tcp://host:port")
    return HostSpec(server=host, port=port)
