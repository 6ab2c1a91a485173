"""The scheduler benchmark's baseline: a plain asyncua script doing what certlm's monitor scan and renewal wave do to
each device, at the same concurrency, with nothing of certlm.

- monitor read, per device what certlm's monitor reads: GetEndpoints (the certificate the device announces), then one
  secure session as the admin user (Aes256Sha256RsaPss SignAndEncrypt, the endpoint certlm picks on the simulated
  devices) reading the trust list (OpenWithMasks, Read, Close), BuildInfo and ServerStatus in one Read,
  GetRejectedList, and the simulated PLC's operating state as the driver of these devices reads it (the namespace
  array, one TranslateBrowsePaths for the PLC's variables, one Read of them);
- renewal, per device what a push must do (``asyncua_baseline.push``): CreateSigningRequest, sign, write the trust
  list, UpdateCertificate, ApplyChanges, and the check that the device presents the new certificate.

The client's key and certificate are parsed once (``asyncua_baseline.BaselineCa``), each session's policy built from
the parsed objects. ``bench_scheduler`` runs it on fresh simulated devices in the same run and prints certlm's figures
over these.

    .venv/bin/python bench/scheduler_baseline.py --concurrency 8 opc.tcp://127.0.0.1:48410 [more URLs]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from asyncua import ua
from asyncua_baseline import BaselineCa, endpoint_presenting, push, secure_client
from common import cpu_seconds

TRUST_LIST = ua.NodeId(ua.ObjectIds.ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList)
SERVER_CONFIGURATION = ua.NodeId(ua.ObjectIds.ServerConfiguration)
TRUST_LIST_IDS = "ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList"
READ_CHUNK = 32 * 1024
STATUS_NODES = [
    ua.NodeId(ua.ObjectIds.Server_ServerStatus_BuildInfo_ManufacturerName),
    ua.NodeId(ua.ObjectIds.Server_ServerStatus_BuildInfo_ProductName),
    ua.NodeId(ua.ObjectIds.Server_ServerStatus_BuildInfo_SoftwareVersion),
    ua.NodeId(ua.ObjectIds.Server_ServerStatus_State),
]


# The simulated PLC's variables its driver reads in each visit (``certlm_opcua_simulator.driver``).
PLC_NAMESPACE = "urn:certlm:simulator"
PLC_VARIABLES = ("OperatingMode", "ProgramName", "CycleTimeMs")


def _trust_list_method(name: str) -> ua.NodeId:
    return ua.NodeId(
        getattr(ua.ObjectIds, f"ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList_{name}")
    )


async def monitor_read(url: str, ca: BaselineCa) -> None:
    """What certlm's monitor reads from one device in one scan."""
    endpoint = await endpoint_presenting(url)
    async with secure_client(url, ca, endpoint) as client:
        trust_list = client.get_node(TRUST_LIST)
        handle = await trust_list.call_method(
            _trust_list_method("OpenWithMasks"), ua.Variant(ua.TrustListMasks.All, ua.VariantType.UInt32)
        )
        handle_argument = ua.Variant(handle, ua.VariantType.UInt32)
        while await trust_list.call_method(
            _trust_list_method("Read"), handle_argument, ua.Variant(READ_CHUNK, ua.VariantType.Int32)
        ):
            pass
        await trust_list.call_method(_trust_list_method("Close"), handle_argument)
        await client.uaclient.read_attributes(STATUS_NODES, ua.AttributeIds.Value)
        await client.get_node(SERVER_CONFIGURATION).call_method(
            ua.NodeId(ua.ObjectIds.ServerConfiguration_GetRejectedList)
        )
        index = (await client.get_namespace_array()).index(PLC_NAMESPACE)
        paths = [ua.RelativePath.from_string(f"/{index}:PLC/{index}:{name}") for name in PLC_VARIABLES]
        found = await client.translate_browsepaths(ua.NodeId(ua.ObjectIds.ObjectsFolder), paths)
        await client.uaclient.read_attributes([result.Targets[0].TargetId for result in found], ua.AttributeIds.Value)


@dataclass
class BaselineRun:
    """One phase of the script over its devices: wall and CPU seconds, and the devices that failed."""

    what: str
    devices: int
    wall_s: float
    cpu_s: float
    failures: list[str]
    devices_cpu_s: float | None = None  # the simulated devices' processes, when their pids were given
    failed_urls: list[str] = field(default_factory=list)

    @property
    def done(self) -> int:
        return self.devices - len(self.failures)

    def line(self) -> str:
        failed = f", {len(self.failures)} failed ({self.failures[0]})" if self.failures else ""
        devices = ""
        if self.devices_cpu_s is not None:
            per_device = f" ({1000 * self.devices_cpu_s / self.done:.1f} ms per device)" if self.done else ""
            devices = f"; simulators CPU {self.devices_cpu_s:.1f} s{per_device}"
        return (
            f"  baseline {self.what}: {self.done}/{self.devices} devices in {self.wall_s:.1f} s, script CPU "
            f"{self.cpu_s:.1f} s{devices}{failed}"
        )


async def run(
    what: str, urls: list[str], ca: BaselineCa, concurrency: int, one: Callable[[str, BaselineCa], Awaitable[None]],
    device_pids: Sequence[int] = (),
) -> BaselineRun:  # fmt: skip
    """``one`` on every device, at most ``concurrency`` at once; the CPU of ``device_pids`` (the simulators) too: on
    a machine of few cores the devices' CPU is a budget the script and certlm share with them."""
    gate = asyncio.Semaphore(concurrency)
    failures: list[str] = []
    failed_urls: list[str] = []

    async def each(url: str) -> None:
        async with gate:
            try:
                await one(url, ca)
            except Exception as error:  # the script counts a failed device and goes on, as a wave does
                failures.append(f"{url}: {type(error).__name__} {error}")
                failed_urls.append(url)

    devices_cpu_before = sum(cpu_seconds(pid) for pid in device_pids)
    started_cpu, started = time.process_time(), time.monotonic()
    await asyncio.gather(*(each(url) for url in urls))
    wall, cpu = time.monotonic() - started, time.process_time() - started_cpu
    devices_cpu = sum(cpu_seconds(pid) for pid in device_pids) - devices_cpu_before if device_pids else None
    return BaselineRun(what, len(urls), wall, cpu, failures, devices_cpu, failed_urls)


async def baseline(
    urls: list[str], concurrency: int, device_pids: Sequence[int] = ()
) -> tuple[BaselineRun, BaselineRun]:
    """The monitor reads, then the renewals, of every device at ``concurrency``; ``device_pids``: the simulators'
    processes, whose CPU each phase reports."""
    # asyncua warns on every session that the simulated device grants 10 minutes, not the hour it asks for, and logs
    # a traceback for each session the device drops as it reopens its endpoints; the script counts real failures.
    logging.getLogger("asyncua").setLevel(logging.CRITICAL)
    ca = await asyncio.to_thread(BaselineCa.create)
    monitor = await run("monitor scan", urls, ca, concurrency, monitor_read, device_pids)
    renewal = await run("renewal wave", urls, ca, concurrency, push, device_pids)
    return monitor, renewal


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("urls", nargs="+")
    args = parser.parse_args()
    for phase in await baseline(args.urls, args.concurrency):
        print(phase.line())


if __name__ == "__main__":
    asyncio.run(main())
