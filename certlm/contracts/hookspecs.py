"""The hooks a certlm plugin implements: device drivers, PKI backends, and extra routes and models.

Every hook here is called synchronously while the app is built. A hook never does I/O: it hands the host
objects (driver and backend classes, blueprints, model module names); the host awaits their async methods
later. That keeps pluggy's result handling simple (an ``async def`` hook would only return a coroutine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pluggy import HookimplMarker, HookspecMarker

if TYPE_CHECKING:
    from quart import Blueprint

    from certlm.contracts.registry import DeviceDriverRegistry, PkiBackendRegistry

hookspec = HookspecMarker("certlm")
hookimpl = HookimplMarker("certlm")


@hookspec
def certlm_register_device_drivers(register: DeviceDriverRegistry) -> None:
    """Register the device drivers this plugin provides.

    Call ``register.add(DriverClass)`` once per driver. ``DriverClass`` subclasses
    ``certlm.contracts.drivers.DeviceDriver`` and declares, as class attributes:

    - ``service``: the service id stored in inventory entries, ``gds-push-<identifier>``,
      ``ssh-<identifier>`` or ``rest-<identifier>``; unique across all installed plugins.
    - ``protocol``: ``"gds"``, ``"ssh"`` or ``"rest"``, the inventory table its entries live in.
    - ``supported_devices``: a tuple of ``certlm.contracts.drivers.SupportedDevice`` (vendor, device name,
      firmware versions) that ``GET /supported-devices`` lists without calling the driver.
    - ``generic``: True for the fallback driver of a protocol, chosen when no specific driver matches.

    The host instantiates the class with a ``certlm.contracts.registry.HostServices`` and routes every REST call
    and scheduler run for an entry with that ``service`` to it. Registering a service id twice raises
    ``certlm.contracts.registry.DuplicateRegistration`` at start-up. Returns nothing.
    """


@hookspec
def certlm_register_pki_backends(register: PkiBackendRegistry) -> None:
    """Register the PKI backends this plugin provides.

    Call ``register.add(BackendClass)`` once per backend. ``BackendClass`` subclasses
    ``certlm.contracts.pki_backends.PkiBackend`` and declares ``pki_type`` (0 none, 1 internal, 2 EST, 3 CMP, or a
    vendor number above 99) and ``name`` (``"none"``, ``"internal"``, ``"est"``, ``"cmp"``, ...). The host
    instantiates it with a ``certlm.contracts.registry.HostServices`` and routes every PKI operation for a PKI entry
    of that type to it: CA chain, CSR enrollment (client and server profiles) and renewal, server-side key
    generation, CRL, configuration validation, revocation. Shared plumbing for PKIs reached over HTTP(S) (the
    entry's TLS trust and client PKCS#12, CRLs from distribution points) is in ``certlm.pki.client``.
    Registering a ``pki_type`` twice raises ``DuplicateRegistration`` at start-up.
    Returns nothing.
    """


@hookspec
def certlm_provide_blueprints() -> list[Blueprint] | None:
    """Return extra Quart blueprints to mount on the app, or ``None`` for none.

    Routes a plugin adds are subject to the host's API-key and license checks like any other route.
    Results of all plugins are collected.
    """


@hookspec
def certlm_provide_model_modules() -> list[str] | None:
    """Return dotted module names that hold tortoise-orm models the plugin stores, or ``None``.

    The modules are loaded into the host's single ``models`` app, so a plugin model can point at host
    models (``fields.ForeignKeyField("models.PkiEntry")``). Their tables are created on a new database and
    by the plugin's own migration steps (see ``certlm.storage.migrations``) on an existing one.
    """
