"""License upload, validation, removal and the endpoint limit's inputs."""

from __future__ import annotations

import base64
import json
from datetime import date, timedelta

import pytest

from tests.support import LicenseKeys


@pytest.fixture
async def unlicensed(make_service):
    return await make_service(licensed=False)


async def test_no_license_stored(unlicensed) -> None:
    async with unlicensed.client() as client:
        response = await client.get("/systeminfo/lic")
    assert response.status_code == 404
    assert response.json() == {"error": "No license stored"}


async def test_install_show_and_remove(unlicensed, license_keys: LicenseKeys) -> None:
    license_b64 = license_keys.issue(endpoints=25, company="Werk Süd AG", license_type="trial")
    async with unlicensed.client() as client:
        assert (await client.get("/gds/systeminfo")).status_code == 403
        created = await client.post("/systeminfo/lic", json={"license_b64": license_b64})
        assert created.status_code == 201
        body = created.json()
        assert body["validation_success"] is True and body["validation_message"] is None
        assert body["company"] == "Werk Süd AG"
        assert body["features"] == ["core"] and body["feature_count"] == 1
        assert body["licensed_endpoints"] == 25
        assert body["license_type"] == "trial" and body["product"] == "certlm"
        assert body["is_currently_valid"] is True and body["is_expired"] is False
        assert body["days_until_expiry"] == 365
        assert (await client.get("/gds/systeminfo")).status_code == 200
        shown = await client.get("/systeminfo/lic")
        assert shown.json() == body
        removed = await client.delete("/systeminfo/lic")
        assert removed.json() == {"validation_success": False, "validation_message": "License removed", "features": []}
        assert (await client.get("/gds/systeminfo")).status_code == 403
        assert (await client.get("/systeminfo/lic")).status_code == 404


def _resign_with_change(license_b64: str, **changes) -> str:
    signed = json.loads(base64.b64decode(license_b64))
    signed["license"].update(changes)
    return base64.b64encode(json.dumps(signed).encode()).decode()


@pytest.mark.parametrize(
    "make_license, message",
    [
        (lambda keys: _resign_with_change(keys.issue(endpoints=5), licensed_endpoints=5000), "signature is invalid"),
        (lambda keys: LicenseKeys.create_other().issue(), "signature is invalid"),
        (
            lambda keys: keys.issue(start=date.today() - timedelta(days=10), end=date.today() - timedelta(days=1)),
            "license expired on",
        ),
        (
            lambda keys: keys.issue(start=date.today() + timedelta(days=3), end=date.today() + timedelta(days=9)),
            "not valid before",
        ),
        (lambda keys: base64.b64encode(b"just some text").decode(), "malformed"),
        (lambda keys: keys.issue()[: len(keys.issue()) // 8 * 4], "malformed"),
        (lambda keys: base64.b64encode(b'{"license": {}, "signature": "!!"}').decode(), "malformed"),
    ],
    ids=["tampered", "other-key", "expired", "not-yet-valid", "not-json", "truncated", "bad-signature-encoding"],
)
async def test_bad_license_is_stored_but_invalid_with_reason(unlicensed, license_keys, make_license, message) -> None:
    async with unlicensed.client() as client:
        response = await client.post("/systeminfo/lic", json={"license_b64": make_license(license_keys)})
        assert response.status_code == 201
        assert response.json()["validation_success"] is False
        assert message in response.json()["validation_message"]
        assert (await client.get("/systeminfo/lic")).json()["validation_message"] == response.json()[
            "validation_message"
        ]
        gated = await client.get("/gds/systeminfo")
        assert gated.status_code == 403
        assert message in gated.json()["error"]


@pytest.mark.parametrize(
    "body, status, error",
    [
        ({"license_b64": "not base64 !!"}, 400, "license_b64 is not valid base64"),
        ({"license_b64": "QUJ"}, 400, "license_b64 is not valid base64"),
        ({"license_b64": ""}, 400, "license_b64"),
        ({"license_b64": 12345}, 400, "license_b64"),
        ({"license_b64": None}, 400, "license_b64"),
        ({}, 400, "license_b64"),
        ({"license_b64": "QUJD", "extra": 1}, 400, "extra"),
    ],
)
async def test_upload_validation(unlicensed, license_keys, body, status, error) -> None:
    async with unlicensed.client() as client:
        await client.post("/systeminfo/lic", json={"license_b64": license_keys.issue()})
        response = await client.post("/systeminfo/lic", json=body)
        assert response.status_code == status
        assert error in response.json()["error"]
        # The valid license installed before is untouched.
        assert (await client.get("/systeminfo/lic")).json()["validation_success"] is True


async def test_license_endpoints_need_the_key_but_no_license(unlicensed) -> None:
    async with unlicensed.client(api_key=None) as anonymous:
        assert (await anonymous.get("/systeminfo/lic")).status_code == 401
    async with unlicensed.client() as client:
        assert (await client.get("/systeminfo/lic")).status_code == 404
