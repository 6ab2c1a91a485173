"""How one push walks through certlm: an onboarding of a simulated device from the internal CA, traced in process.

Prints the chain of certlm modules from the route to the driver's ``push`` and to the PKI backend's ``enroll``
(each module once per stretch of frames in it), and how often plugin code calls back into the host's lifecycle or
PKI rooms during the push (a push that walks down the rooms has none).

    .venv/bin/python scripts/push_hops.py
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import tempfile
import types
from collections import Counter
from pathlib import Path

from certlm.testing import (
    InProcessApp,
    LicenseKeys,
    SimulatedDevices,
    create_internal_ca,
    in_process_settings,
    licensed_app,
    push,
)

# Code that is not certlm's own walk: the test kit that starts the push, the simulated device serving it.
NOT_WALKED = ("certlm.testing", "certlm_opcua_simulator")
HOST_ROOMS_CALLED_BACK = ("certlm.lifecycle", "certlm.pki")
PKI_BACKEND_MODULES = ("certlm_pki_", "certlm.builtin")
ASYNC_CODE = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def module_of(frame: types.FrameType) -> str | None:
    name = frame.f_globals.get("__name__", "")
    if not name.startswith("certlm") or name.startswith(NOT_WALKED):
        return None
    return name


def chain(frame: types.FrameType | None) -> list[str]:
    """The certlm modules on the stack, outermost first, each stretch of frames in one module named once."""
    modules: list[str] = []
    while frame is not None:
        module = module_of(frame)
        if module is not None and (not modules or modules[-1] != module):
            modules.append(module)
        frame = frame.f_back
    return list(reversed(modules))


class Walk:
    def __init__(self) -> None:
        self.to_driver: list[str] | None = None
        self.to_backend: list[str] | None = None
        self.callbacks: Counter[str] = Counter()
        self.started: set[types.FrameType] = set()

    def profile(self, frame: types.FrameType, event: str, _: object) -> None:
        if event != "call":
            return
        callee = module_of(frame)
        if callee is None or frame in self.started:
            return  # not certlm's, or a coroutine resumed after an await rather than called
        if frame.f_code.co_flags & ASYNC_CODE:
            self.started.add(frame)  # held until the end: one push's frames
        code = frame.f_code
        if code.co_name == "push" and "target" in code.co_varnames[: code.co_argcount] and self.to_driver is None:
            self.to_driver = chain(frame)
        if callee.startswith(PKI_BACKEND_MODULES) and self.to_backend is None:
            self.to_backend = chain(frame)
        caller = module_of(frame.f_back) if frame.f_back is not None else None
        if caller and not caller.startswith("certlm.") and callee.startswith(HOST_ROOMS_CALLED_BACK):
            self.callbacks[f"{caller} -> {callee}.{code.co_name}"] += 1


async def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        keys = LicenseKeys.create(root / "keys")
        async with licensed_app(in_process_settings(root / "data", keys), keys) as app:
            await create_internal_ca(app)
            devices = SimulatedDevices(root / "devices")
            device = await devices.start()
            try:
                await walk_one_push(app, device)
            finally:
                await devices.stop_all()


async def walk_one_push(app: InProcessApp, device: object) -> None:
    walk = Walk()
    sys.setprofile(walk.profile)
    try:
        await push(app, device)
    finally:
        sys.setprofile(None)
    for what, modules in (("route to driver", walk.to_driver), ("route to PKI backend", walk.to_backend)):
        print(f"{what}: {len(modules or []) - 1} hops")
        print("    " + "\n    -> ".join(modules or ["(not reached)"]))
    print(f"calls from plugin code back into the host's lifecycle and PKI rooms: {sum(walk.callbacks.values())}")
    for call, count in walk.callbacks.most_common():
        print(f"    {count} x {call}")


if __name__ == "__main__":
    asyncio.run(main())
