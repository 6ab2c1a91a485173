"""The app factory: settings, secrets, plugins, storage, routes, and the checks every request passes."""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import logging
from functools import partial
from types import FunctionType
from typing import Any

import quart_schema.conversion
from cryptography import x509
from pydantic import TypeAdapter
from quart import Quart, request
from quart_schema import QuartSchema
from tortoise.expressions import Q

from certlm.contracts.enrollment import CLIENT_PROFILE, Enrollment
from certlm.contracts.registry import DeviceDriverRegistry, PkiBackendRegistry
from certlm.contracts.services import ClientCertificateIssuer, HostServices
from certlm.foundation.config import Settings
from certlm.foundation.errors import register_error_handlers
from certlm.foundation.loop_watch import LoopWatch
from certlm.foundation.secretbox import SecretBox, private_directory
from certlm.foundation.version import __version__
from certlm.http.auth import install_access_checks, load_or_create_api_key
from certlm.http.openapi import CertlmOpenAPIProvider
from certlm.http.plugins import build_plugin_manager, register_device_drivers
from certlm.http.request_bodies import install_body_checks
from certlm.http.schema_guard import install_schema_guard
from certlm.inventory.entries import Inventory
from certlm.lifecycle.access import HostInventoryAccess
from certlm.lifecycle.campaigns import RETIRE, CampaignRunner
from certlm.lifecycle.identification import IdentificationQueue
from certlm.lifecycle.issuers import CA_ROLLOVER, FINISHED, PKI_MIGRATION
from certlm.lifecycle.metrics import SchedulerMetrics
from certlm.lifecycle.monitoring import monitor_scan
from certlm.lifecycle.renewal import renewal_scan
from certlm.lifecycle.runtime import Runtime
from certlm.lifecycle.schedulers import Scheduler, Schedulers
from certlm.pki.entries import INTERNAL_PKI_TYPE
from certlm.pki.publication import PublishedCrls
from certlm.pki.revocation import CrlCache
from certlm.service.backup import ScheduledBackups
from certlm.service.host import Host
from certlm.storage import close_storage, open_storage
from certlm.storage.migrations import checked_plugin_migrations
from certlm.storage.models import Campaign, PkiEntry
from certlm.storage.reads import reads_once
from certlm.system.licensing import LicenseService

log = logging.getLogger(__name__)

# One module per area of the API, each exporting ``blueprint``.
BLUEPRINT_MODULES: tuple[str, ...] = (
    "certlm.http.blueprints.system",
    "certlm.http.blueprints.license",
    "certlm.http.blueprints.tls",
    "certlm.http.blueprints.inventory",
    "certlm.http.blueprints.push",
    "certlm.http.blueprints.monitoring",
    "certlm.http.blueprints.certificate_detail",
    "certlm.http.blueprints.trust_lists",
    "certlm.http.blueprints.pki",
    "certlm.http.blueprints.maintenance",
    "certlm.http.blueprints.campaigns",
    "certlm.http.blueprints.rejected",
    "certlm.http.blueprints.admin",
    "certlm.http.blueprints.docs",
    "certlm.http.blueprints.dashboard",
    "certlm.http.blueprints.metrics",
    "certlm.http.blueprints.audit",
    "certlm.http.blueprints.apikeys",
)


def internal_ca_client_issuer(pki_backends: PkiBackendRegistry) -> ClientCertificateIssuer:
    """``HostServices.issue_client_certificate``: the newest internal CA PKI entry that no campaign retired signs under
    the client profile; None while there is none (or no internal CA plugin).

    The newest, because an operator makes a CA to be used from then on (a rollover's successor is newer than the CA
    it follows). Not a retired one: a finished ``ca-rollover`` or ``pki-migration`` campaign, or one in its retire
    phase, took its ``from_pki_id``'s CA out of its devices' trust lists, and a client certificate it issued would
    lock certlm out of them."""

    async def issue(csr: x509.CertificateSigningRequest) -> Enrollment | None:
        if not pki_backends.known(INTERNAL_PKI_TYPE):
            return None
        retired = await Campaign.filter(
            Q(state=FINISHED) | Q(phase=RETIRE), kind__in=(CA_ROLLOVER, PKI_MIGRATION)
        ).values_list("from_pki_id", flat=True)
        ca_entry = (
            await PkiEntry.filter(pki_type=INTERNAL_PKI_TYPE).exclude(id__in=list(retired)).order_by("-id").first()
        )
        if ca_entry is None:
            return None
        return await pki_backends.get(INTERNAL_PKI_TYPE).enroll(ca_entry, csr, CLIENT_PROFILE)

    return issue


def build_host(settings: Settings) -> Host:
    """The host's parts for ``settings``: the installed plugins loaded and their drivers and backends made, the
    runtime every operation is handed, the schedulers, metrics and identification queue."""
    private_directory(settings.data_dir)
    secrets = SecretBox.from_key_file(settings.secrets_dir / "certlm_secret.key")
    pki_backends = PkiBackendRegistry()
    drivers = DeviceDriverRegistry()
    services = HostServices(
        settings=settings,
        secrets=secrets,
        issue_client_certificate=internal_ca_client_issuer(pki_backends),
        drivers=drivers,
    )
    plugin_manager = build_plugin_manager(settings.disabled_plugins)
    register_device_drivers(plugin_manager, drivers)
    drivers.instantiate(services)
    plugin_manager.hook.certlm_register_pki_backends(register=pki_backends)
    pki_backends.instantiate(services)
    licenses = LicenseService(settings.license_public_key_file)
    runtime = Runtime(
        settings=settings,
        secrets=secrets,
        services=services,
        drivers=drivers,
        pki_backends=pki_backends,
        licenses=licenses,
        crl_cache=CrlCache(),
        inventory=Inventory(drivers, secrets, licenses),
        client_certificates=tuple(
            holder
            for holders in plugin_manager.hook.certlm_provide_client_certificates(services=services)
            for holder in holders or ()
        ),
    )
    host = Host(
        runtime=runtime,
        plugin_manager=plugin_manager,
        api_key=load_or_create_api_key(settings.api_key_file),
        schedulers=Schedulers(
            [
                Scheduler("gds_push", partial(renewal_scan, runtime)),
                Scheduler("monitor", partial(monitor_scan, runtime)),
            ]
        ),
        metrics=SchedulerMetrics(),
        identification=IdentificationQueue(runtime),
        published_crls=PublishedCrls(),
        campaigns=CampaignRunner(runtime),
    )
    for scheduler in host.schedulers.by_name.values():
        scheduler.on_scan_finished.append(host.metrics.scan_finished)
    return host


@functools.cache
def _type_adapter_of(type_: Any) -> TypeAdapter:
    return TypeAdapter(type_)


def reused_type_adapter(type_: Any) -> TypeAdapter:
    """The ``TypeAdapter`` of ``type_``, made once per type: quart-schema makes one per call, at every request for
    its body's model (``validate_request``) and for every dict answered (``TypeAdapter(dict)``, which builds its
    schema anew: some 180 Python calls of each plain answer). Reusing one answers the same."""
    try:
        return _type_adapter_of(type_)
    except TypeError:  # a type that cannot be a dict key (an ``Annotated`` with a list, say): made per call
        return TypeAdapter(type_)


def install_openapi(app: Quart) -> None:
    quart_schema.conversion.TypeAdapter = reused_type_adapter  # type: ignore[misc,assignment]
    # /docs is certlm's own page (blueprints/docs.py): quart-schema's would load Swagger UI from the internet.
    # CertlmOpenAPIProvider completes what quart-schema generates: every status, media type and open route.
    QuartSchema(
        app,
        openapi_provider_class=CertlmOpenAPIProvider,
        openapi_path="/openapi.json",
        swagger_ui_path=None,
        redoc_ui_path=None,
        scalar_ui_path=None,
        info={"title": "certlm", "version": __version__},
        security_schemes={
            "apiKey": {"type": "apiKey", "in_": "header", "name": "X-API-Key"},
            "bearer": {"type": "http", "scheme": "bearer"},
        },
        security=[{"apiKey": []}, {"bearer": []}],
    )


class CertlmQuart(Quart):
    """Quart, with one difference: a ``CancelledError`` that reaches a request's handling while no one cancelled its
    task (it came from a future or task the handler awaited, which something else cancelled) is an unexpected error,
    answered as one: a JSON 500, its traceback logged. Quart passes every ``CancelledError`` on as the request's
    cancellation, and hypercorn then answers a request left without a response with an empty 500. A request its
    client dropped, or one cancelled as certlm stops, has its task cancelled and goes on being cancelled."""

    def ensure_async(self, func: Any) -> Any:
        # Quart asks this of every hook, handler and view at every request; an ``async def`` function is told by its
        # code's flag here, in one step rather than the ten calls of asyncio's ``iscoroutinefunction``.
        if type(func) is FunctionType and func.__code__.co_flags & inspect.CO_COROUTINE:
            return func
        return super().ensure_async(func)

    async def full_dispatch_request(self, request_context: Any = None) -> Any:
        try:
            return await super().full_dispatch_request(request_context)
        except asyncio.CancelledError as cancelled:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise
            log.error("a wait inside %s %s was cancelled, not the request", request.method, request.path,
                      exc_info=cancelled)  # fmt: skip
            return await self.finalize_request(
                ({"error": f"internal error: {type(cancelled).__name__}"}, 500), request_context
            )


def install_request_reads(app: Quart) -> None:
    """Each HTTP request reads a shared row once (``certlm.storage.reads``): the license its checks and its route ask
    for, a push's CA row and credential. Opened around the request's handling, which Quart runs in tasks of its own
    (they take this scope with them), and closed when the response is sent."""
    handle = app.asgi_app

    async def asgi_app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await handle(scope, receive, send)
        with reads_once():
            return await handle(scope, receive, send)

    app.asgi_app = asgi_app  # type: ignore[method-assign]


def create_app(settings: Settings | None = None) -> Quart:
    settings = settings or Settings.from_env()
    host = build_host(settings)
    plugin_manager = host.plugin_manager

    app = CertlmQuart("certlm", static_folder=None)
    # opc.tcp://host:port arrives as a path parameter; its "//" must not be merged away.
    app.url_map.merge_slashes = False
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.config["QUART_SCHEMA_CONVERT_CASING"] = False
    # Background work (the demo onboarding its devices) is best effort; shutdown need not wait long for it.
    app.config["BACKGROUND_TASK_SHUTDOWN_TIMEOUT"] = 1
    app.extensions["certlm"] = host
    install_openapi(app)
    install_request_reads(app)
    register_error_handlers(app)
    install_access_checks(app)
    install_body_checks(app)
    install_schema_guard(app)
    host.model_modules = [m for modules in plugin_manager.hook.certlm_provide_model_modules() for m in modules or ()]
    host.plugin_migrations = [s for steps in plugin_manager.hook.certlm_provide_migrations() for s in steps or ()]
    checked_plugin_migrations(host.plugin_migrations)  # a plugin's miscounted versions stop start-up before any I/O

    # Registered before any blueprint, so a blueprint's own ``before_app_serving`` finds the database open.
    @app.before_serving
    async def start_storage() -> None:
        host.schema_version = await open_storage(settings.database_url, host.model_modules, host.plugin_migrations)
        host.schedulers.start()
        host.identification.start()
        host.campaigns.start()

    if settings.loop_watch:
        trace_after_s = settings.loop_trace_ms / 1000 if settings.loop_trace_ms else None
        loop_watch = LoopWatch(host.metrics.loop_delay_observed, trace_after_s=trace_after_s)
        app.before_serving(loop_watch.start)
        app.after_serving(loop_watch.stop)

    scheduled_backups = ScheduledBackups.from_settings(settings)  # a bad backup setting stops start-up, named
    if scheduled_backups is not None:
        app.before_serving(scheduled_backups.start)
        app.after_serving(scheduled_backups.stop)

    for module_name in BLUEPRINT_MODULES:
        app.register_blueprint(importlib.import_module(module_name).blueprint)
    inventory_access = HostInventoryAccess(host.runtime, host.identification)
    for blueprints in plugin_manager.hook.certlm_provide_blueprints(services=host.services, inventory=inventory_access):
        for blueprint in blueprints or ():
            app.register_blueprint(blueprint)

    @app.after_serving
    async def stop_storage() -> None:
        await host.identification.stop()
        await host.campaigns.stop()
        await host.schedulers.stop()
        await close_storage()

    return app
