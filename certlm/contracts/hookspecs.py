"""The hooks a certlm plugin implements: device drivers, PKI backends, and extra routes, models and migrations.

Every hook here is called synchronously while the app is built. A hook never does I/O: it hands the host
objects (driver and backend classes, blueprints, model module names, migration steps); the host awaits their async
methods later. That keeps pluggy's result handling simple (an ``async def`` hook would only return a coroutine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pluggy import HookimplMarker, HookspecMarker

if TYPE_CHECKING:
    from quart import Blueprint

    from certlm.contracts.registry import DeviceDriverRegistry, PkiBackendRegistry
    from certlm.contracts.services import ClientCertificateHolder, HostServices, InventoryAccess
    from certlm.storage.migrations import PluginMigration

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
def certlm_provide_blueprints(services: HostServices, inventory: InventoryAccess) -> list[Blueprint] | None:
    """Return extra Quart blueprints to mount on the app, or ``None`` for none.

    ``services`` is what the host lends every plugin (settings, the encryption of secrets, device time-outs);
    ``inventory`` is the inventory as routes use it (``certlm.InventoryAccess``: find, create, update and delete
    entries, store credentials, identify a device, render and list entries). A plugin makes its blueprint with
    what it is given, usually in a function that closes over them, and looks nothing up. A hook implementation may
    take only the arguments it uses. Routes a plugin adds are subject to the host's API-key and license checks like
    any other route, and documented in ``/openapi.json`` under the plugin's name. Results of all plugins are
    collected.
    """


@hookspec
def certlm_provide_client_certificates(services: HostServices) -> list[ClientCertificateHolder] | None:
    """Return the client certificates this plugin presents to devices, or ``None`` for none. Plugin API 1.1.

    Each is a ``certlm.ClientCertificateHolder``: a plugin whose driver logs in to devices with a certificate of
    certlm's own (the OPC UA client application of GDS push) hands the host an object that reads the certificate it
    presents and renews it. Before a campaign's retire phase takes an issuer out of the devices' trust lists, the host
    renews every such certificate that issuer signed from the campaign's new issuer (client profile), so devices keep
    accepting certlm; until that is done for all of them the campaign waits, ``blocked`` naming why. ``services`` is
    what the host lends every plugin (settings, the encryption of secrets, ``issue_client_certificate`` for a first
    certificate); the holder keeps it. Results of all plugins are collected.
    """


@hookspec
def certlm_provide_model_modules() -> list[str] | None:
    """Return dotted module names that hold tortoise-orm models the plugin stores, or ``None``.

    The modules are loaded into the host's single ``models`` app, so a plugin model can point at host
    models (``fields.ForeignKeyField("models.PkiEntry")``). A table that does not exist yet is created from its
    model at start-up, on a new database or an existing one; a change to a table an earlier release of the plugin
    created is a migration step (``certlm_provide_migrations``).
    """


@hookspec
def certlm_provide_migrations() -> list[PluginMigration] | None:
    """Return the plugin's schema migration steps (``certlm.PluginMigration``), or ``None``.

    Each step names the plugin (its entry point name), a version counting from 1, a description and an ``apply``
    coroutine that alters the plugin's own tables through the ``certlm.SchemaEditor`` it is given (``execute``,
    ``table_exists``, ``column_exists``, ``add_column``). At start-up, after the host's own migrations, certlm runs
    every step above the version it stored for the plugin, each in a transaction with its new stamp, so a failing
    step leaves nothing behind and stops start-up naming the plugin and the step. Steps must be idempotent (check
    before altering): a fresh install has the tables of the current models already. Keep every step of every
    release: a database may come from any of them.
    """
