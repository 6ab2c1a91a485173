"""The inventory as plugins' routes use it (``certlm.contracts.services.InventoryAccess``): the host's inventory, its
identification queue and the decommissioning of a device, behind the methods the contract documents."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from certlm.foundation.hostspec import HostSpec
from certlm.inventory.entries import ListingPage, find_entry, find_entry_at
from certlm.lifecycle.identification import IdentificationQueue
from certlm.lifecycle.push import decommission
from certlm.lifecycle.runtime import Runtime
from certlm.storage.models import InventoryEntry

Description = TypeVar("Description")


class HostInventoryAccess:
    def __init__(self, runtime: Runtime, identification: IdentificationQueue) -> None:
        self.runtime = runtime
        self.identification = identification

    def parse_address(self, host_or_url: str) -> HostSpec:
        return self.runtime.drivers.parse_address(host_or_url)

    async def find(self, address: str | HostSpec, tables: tuple[str, ...]) -> InventoryEntry:
        spec = self.parse_address(address) if isinstance(address, str) else address
        return await find_entry(spec, tables)

    async def find_at(self, server: str, port: int, table: str) -> InventoryEntry | None:
        return await find_entry_at(server, port, table)

    async def create(self, table: str, server: str, port: int | None, columns: dict[str, Any]) -> InventoryEntry:
        return await self.runtime.inventory.create_entry(table, server, port, columns)

    async def update(self, entry: InventoryEntry, columns: dict[str, Any]) -> None:
        await self.runtime.inventory.update_entry(entry, columns)

    async def save_credentials(
        self, entry: InventoryEntry, *, username: str | None = None, password: str | None = None
    ) -> None:
        await self.runtime.inventory.save_credentials(entry, username=username, password=password)

    async def identify(self, entry: InventoryEntry) -> None:
        await self.identification.identify(entry)

    def url(self, entry: InventoryEntry) -> str:
        return self.runtime.inventory.entry_url(entry)

    async def render(self, entry: InventoryEntry) -> dict[str, Any]:
        return await self.runtime.inventory.render_entry(entry)

    def listing(self, tables: tuple[str, ...], limit: int | None, after_id: int) -> AsyncIterator[bytes]:
        return self.runtime.inventory.listing_json(tables, ListingPage(limit=limit, after_id=after_id))

    async def delete(
        self, entry: InventoryEntry, describe: Callable[[InventoryEntry], Awaitable[Description]]
    ) -> Description:
        return await decommission(self.runtime, entry, describe)
