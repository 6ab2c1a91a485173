"""The installed license: upload, validation, removal. Needs the API key but no license."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from quart import Blueprint
from quart_schema import validate_request, validate_response

from certlm.errors import APIError, NotFound
from certlm.host import current_host
from certlm.inventory import licensed_endpoints_in_use
from certlm.licensing import LicenseFormatError, LicenseRefused, decode_base64
from certlm.openapi import answers

blueprint = Blueprint("license", __name__)


class LicenseUpload(BaseModel):
    model_config = ConfigDict(extra="forbid")

    license_b64: str = Field(strict=True, min_length=1, max_length=65536)


class LicenseOut(BaseModel):
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
    licensed_endpoints_in_use: int | None = Field(
        default=None, description="extension: the managed endpoints that count against licensed_endpoints now"
    )


class LicenseRemoved(BaseModel):
    validation_success: bool
    validation_message: str
    features: list[str]


@blueprint.post("/systeminfo/lic")
@validate_response(LicenseOut, 201)
@validate_request(LicenseUpload)
@answers(LicenseRefused)
async def install_license(data: LicenseUpload) -> tuple[LicenseOut, int]:
    """Store and validate a license file (base64); the answer is its validation. 400 when it is not base64; 409
    when it does not validate while a valid license is in force, which then stays (the answer says which)."""
    try:
        decode_base64(data.license_b64)
    except LicenseFormatError as error:
        raise APIError(str(error)) from None
    status = await current_host().licenses.install(data.license_b64)
    return LicenseOut(**status.as_dict(), licensed_endpoints_in_use=await licensed_endpoints_in_use()), 201


@blueprint.get("/systeminfo/lic")
@validate_response(LicenseOut)
@answers(NotFound)
async def show_license() -> LicenseOut:
    """The installed license, validated now."""
    status = await current_host().licenses.current(fresh=True)
    if status is None:
        raise NotFound("No license stored")
    return LicenseOut(**status.as_dict(), licensed_endpoints_in_use=await licensed_endpoints_in_use())


@blueprint.delete("/systeminfo/lic")
@validate_response(LicenseRemoved)
async def remove_license() -> LicenseRemoved:
    """Remove the license; feature-gated endpoints answer 403 until another is installed."""
    await current_host().licenses.remove()
    return LicenseRemoved(validation_success=False, validation_message="License removed", features=[])
