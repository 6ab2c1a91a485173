"""The installed license: upload (or its dry run), validation, removal, and putting the previous license back. Needs
the API key but no license."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from quart import Blueprint
from quart_schema import validate_querystring, validate_request, validate_response

from certlm.foundation.actors import ADMIN, VIEWER
from certlm.foundation.errors import APIError, NotFound
from certlm.http.auth import requires_role
from certlm.http.openapi import answers
from certlm.inventory.entries import licensed_endpoints_in_use
from certlm.service.host import current_host
from certlm.system.licensing import LicenseChange, LicenseFormatError, decode_base64

blueprint = Blueprint("license", __name__)


class LicenseUpload(BaseModel):
    model_config = ConfigDict(extra="forbid")

    license_b64: str = Field(strict=True, min_length=1, max_length=65536)


class DryRun(BaseModel):
    dry_run: bool = Field(
        default=False,
        description="extension: true validates and answers what would be installed and replaced, storing nothing "
        "(true/false, 1/0, yes/no, on/off)",
    )


class LicenseFields(BaseModel):
    """The spec's License (Lic)."""

    validation_success: bool
    validation_message: str | None
    company: str | None
    features: list[str]
    feature_count: int | None
    licensed_endpoints: int | None
    validity_start: str | None
    validity_end: str | None
    product: str | None
    product_version: str | None
    license_type: str | None
    is_currently_valid: bool | None
    days_until_expiry: int | None
    is_expired: bool | None


DESCRIPTION = "extension: which license this is, for a person: type, company and validity"


class LicenseOut(LicenseFields):
    description: str = Field(description=DESCRIPTION)
    licensed_endpoints_in_use: int | None = Field(
        default=None, description="extension: the managed endpoints that count against licensed_endpoints now"
    )


class ReplacedLicense(LicenseFields):
    description: str = Field(description=DESCRIPTION)


class LicenseChangeOut(LicenseOut):
    """The Lic of the license installed (restored), or for a dry run the one that would be, with what it changes."""

    dry_run: bool = Field(description="extension: true when nothing was stored (?dry_run=true)")
    service_licensed: bool = Field(
        description="extension: whether the service is licensed (a valid license with feature core) after this "
        "request; for a dry run, whether it would be. false means every feature-gated route answers 403"
    )
    replaced_license: ReplacedLicense | None = Field(
        description="extension: the license that was in force and is now kept as the previous one (for a dry run: "
        "that would be); null when none was installed"
    )
    summary: str = Field(description="extension: what was done (would be done), in sentences for a person")


class LicenseCheckOut(LicenseChangeOut):
    """What installing the license would do (``?dry_run=true``): its Lic and what it would change; nothing stored."""


async def change_out(change: LicenseChange, model: type[LicenseChangeOut] = LicenseChangeOut) -> LicenseChangeOut:
    replaced = change.replaced
    return model(
        **change.installed.as_dict(),
        licensed_endpoints_in_use=await licensed_endpoints_in_use(),
        description=change.installed.describe(),
        dry_run=not change.stored,
        service_licensed=change.service_licensed,
        replaced_license=ReplacedLicense(**replaced.as_dict(), description=replaced.describe()) if replaced else None,
        summary=change.summary(),
    )


class LicenseRemoved(BaseModel):
    validation_success: bool
    validation_message: str
    features: list[str]


@blueprint.post("/systeminfo/lic")
@requires_role(ADMIN)
@validate_querystring(DryRun)
@validate_response(LicenseChangeOut, 201)
@validate_response(LicenseCheckOut, 200)
@validate_request(LicenseUpload)
async def install_license(data: LicenseUpload, query_args: DryRun) -> tuple[LicenseChangeOut, int]:
    """Install a license file: stored and validated at once, or only validated with ?dry_run=true.

    The answer (201) is the license's validation. A file that does not validate is stored too: the service is then
    unlicensed, every feature-gated route answers 403 until a valid license is installed, and the answer says so
    (``service_licensed`` false, ``summary``). The license it replaces is kept as the previous one
    (``replaced_license``; ``POST /systeminfo/lic/restore`` puts it back). ``?dry_run=true`` answers the same (200)
    and stores nothing. 400 when ``license_b64`` is not base64."""
    try:
        decode_base64(data.license_b64)
    except LicenseFormatError as error:
        raise APIError(str(error)) from None
    change = await current_host().licenses.install(data.license_b64, dry_run=query_args.dry_run)
    if query_args.dry_run:
        return await change_out(change, LicenseCheckOut), 200
    return await change_out(change), 201


@blueprint.post("/systeminfo/lic/restore")
@requires_role(ADMIN)
@validate_querystring(DryRun)
@validate_response(LicenseChangeOut)
@answers(NotFound)
async def restore_license(query_args: DryRun) -> LicenseChangeOut:
    """Extension: put the previous license back, or with ?dry_run=true tell what that would do.

    The previous license is the one the last upload, restore or removal replaced; the license in force becomes the
    previous one, so another restore undoes this. The answer is the restored license's validation and what it
    replaced. ``?dry_run=true`` answers the same and changes nothing. 404 when no previous license is kept."""
    return await change_out(await current_host().licenses.restore(dry_run=query_args.dry_run))


@blueprint.get("/systeminfo/lic")
@requires_role(VIEWER)
@validate_response(LicenseOut)
@answers(NotFound)
async def show_license() -> LicenseOut:
    """The installed license, validated now."""
    status = await current_host().licenses.current(fresh=True)
    if status is None:
        raise NotFound("No license stored")
    return LicenseOut(
        **status.as_dict(), description=status.describe(), licensed_endpoints_in_use=await licensed_endpoints_in_use()
    )


@blueprint.delete("/systeminfo/lic")
@requires_role(ADMIN)
@validate_response(LicenseRemoved)
async def remove_license() -> LicenseRemoved:
    """Remove the license; feature-gated endpoints answer 403 until another is installed. The removed license is kept
    as the previous one: ``POST /systeminfo/lic/restore`` puts it back."""
    await current_host().licenses.remove()
    return LicenseRemoved(validation_success=False, validation_message="License removed", features=[])
