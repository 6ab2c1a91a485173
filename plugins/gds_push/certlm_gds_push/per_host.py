"""What the plugin keeps for each certlm host: one per host that lent the ``HostServices`` (an app in a test's
process is one host among several), made at its first use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from certlm import HostServices

T = TypeVar("T")


class PerHost(Generic[T]):
    """``per_host(services)``: the one ``T`` of the host that lent ``services``, made by ``make(services)`` the first
    time. Held by the services' identity and checked against them, so a host made where a finished one was is not
    given what the finished one held."""

    def __init__(self, make: Callable[[HostServices], T]) -> None:
        self._make = make
        self._held: dict[int, tuple[HostServices, T]] = {}

    def __call__(self, services: HostServices) -> T:
        held = self._held.get(id(services))
        if held is None or held[0] is not services:
            held = self._held[id(services)] = (services, self._make(services))
        return held[1]
