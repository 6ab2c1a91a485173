"""``GET /gds/crt``: certlm's own OPC UA client certificate, created at first start, for devices to trust."""

from __future__ import annotations

import logging

from cryptography import x509
from quart import Blueprint, Response
from quart_schema import validate_querystring

from certlm import VIEWER, DownloadQuery, HostServices, NotFound, answers, downloads, requires_role, to_pem
from certlm_gds_push.identity import client_identity, stored_client_identity

log = logging.getLogger(__name__)

_MIMETYPES = {"pem": "application/x-pem-file", "der": "application/pkix-cert"}


def make_blueprint(services: HostServices) -> Blueprint:
    """The plugin's routes, with the host's settings and secrets that make certlm's client identity."""
    blueprint = Blueprint("gds_push", __name__)

    @blueprint.before_app_serving
    async def create_client_identity() -> None:
        try:
            identity = await client_identity(services)
        except Exception:
            # The internal CA could not sign (for example a broken CA entry): the service still starts, the identity
            # is created at first use, and /gds/crt answers 404 until then.
            log.exception("could not create certlm's OPC UA client certificate")
            return
        log.info("certlm's OPC UA client application: %s", identity.application_uri)

    @blueprint.get("/gds/crt")
    @requires_role(VIEWER)
    @validate_querystring(DownloadQuery)
    @downloads(*_MIMETYPES.values(), description="certlm's OPC UA client certificate")
    @answers(NotFound)
    async def download_client_certificate(query_args: DownloadQuery) -> Response:
        """certlm's OPC UA client application instance certificate (``format`` = ``pem`` or ``der``), to put into a
        device's trust list by hand when the device does not trust certlm yet."""
        stored = await stored_client_identity()
        if stored is None:
            raise NotFound("OPCUA client certificate not found")
        certificate = x509.load_der_x509_certificate(stored.certificate_der)
        body = stored.certificate_der if query_args.format == "der" else to_pem(certificate).encode()
        response = Response(body, mimetype=_MIMETYPES[query_args.format])
        response.headers["Content-Disposition"] = f'attachment; filename="certlm-opcua-client.{query_args.format}"'
        return response

    return blueprint
