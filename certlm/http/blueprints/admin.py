"""Database administration: a sample database to try the service with, and the TOTP-guarded wipe."""

from __future__ import annotations

from quart import Blueprint
from quart_schema import validate_response

from certlm.foundation.actors import ADMIN
from certlm.foundation.responses import OperationResult, operation_result
from certlm.http.auth import TOTP, failure_limiter, request_route, request_source, requires_role
from certlm.service.admin import TotpRefused, create_sample_data, wipe_with_totp
from certlm.service.host import current_host

blueprint = Blueprint("admin", __name__)


@blueprint.post("/create/dummy-db")
@requires_role(ADMIN)
@validate_response(OperationResult)
async def create_sample_database() -> OperationResult:
    """Fill the database with sample entries: three GDS devices (one inactive) and an SSH gateway, an EST
    and (when the internal CA backend is installed) an internal PKI entry, and a weekly maintenance window.
    Samples that already exist (by server and port, or by name) are left alone; 403 when the devices would
    exceed the license endpoint limit. Sample passwords are stored encrypted."""
    counts = await create_sample_data(current_host().runtime)
    return OperationResult(**operation_result("sample database created", counts))


@blueprint.delete("/sql/<totp_code>")
@requires_role(ADMIN, spec_key_only=True)
@validate_response(OperationResult)
async def wipe_database(totp_code: str) -> OperationResult:
    """Irreversibly delete the inventory, user credentials, PKI configuration, CA and device certificates,
    maintenance windows and every plugin's stored rows. Kept: the license, the schema version, the system
    settings, the API server's TLS certificate and the audit trail.

    ``totp_code`` is the current 6-digit TOTP (RFC 6238, SHA-1, 30 s steps) whose secret is the API key:
    ``base32(api_key as UTF-8)`` without padding. The previous and next step are accepted for clock drift;
    a code is accepted once only, and no code older than the last accepted one. 401 ``Invalid TOTP code``
    otherwise. A source address that sent ``CERTLM_AUTH_FAILURE_LIMIT`` wrong six-digit codes within
    ``CERTLM_AUTH_FAILURE_WINDOW_S`` is answered 429 (``Retry-After``) until that window ends, whatever code it
    sends."""
    limiter, source = failure_limiter(TOTP), request_source()
    limiter.check(source)
    try:
        deleted = await wipe_with_totp(totp_code, current_host().api_key)
    except TotpRefused as refused:
        limiter.refused(source, request_route(), refused.reason, counts=refused.counts)
        raise
    return OperationResult(**operation_result("database deleted", {"deleted": deleted}))
