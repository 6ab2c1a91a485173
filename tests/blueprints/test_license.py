"""License upload, validation and removal: a wrong file never takes the license in force away, and every answer
explains itself."""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncIterator
from datetime import date, timedelta

import pytest

from certlm.app import create_app
from tests.support import InProcessApp, LicenseKeys, in_process_settings
from tests.test_licensing import assert_is_a_sentence, tampered

PAST = (date.today() - timedelta(days=10), date.today() - timedelta(days=1))
FUTURE = (date.today() + timedelta(days=3), date.today() + timedelta(days=9))

# Files a person may paste instead of the right license, and what the answer must say about each.
WRONG_FILES = [
    pytest.param(lambda keys: "AAAA", "the license is not a certlm license file: its text is not JSON", id="AAAA"),
    pytest.param(
        lambda keys: base64.b64encode(b"\x30\x82\x03\x5c\x30\x82\x02\x44\xa0").decode(),
        "the license is not a certlm license file: it is binary data, not text (byte 1 is 0x82)",
        id="binary-certificate",
    ),
    pytest.param(
        lambda keys: base64.b64encode(b"[" * 40_000).decode(),
        "the license is not a certlm license file: its JSON is nested far deeper than a license's",
        id="deeply-nested",
    ),
    pytest.param(
        lambda keys: base64.b64encode(b'[{"license": 1}]').decode(),
        'the license is not a certlm license file: its JSON has no "license" and "signature"',
        id="json-of-wrong-shape",
    ),
    pytest.param(tampered, "the license signature is invalid", id="tampered"),
    pytest.param(lambda keys: LicenseKeys.create_other().issue(), "signed by another key", id="other-key"),
    pytest.param(lambda keys: keys.issue(start=PAST[0], end=PAST[1]), "the license expired on", id="expired"),
    pytest.param(lambda keys: keys.issue(start=FUTURE[0], end=FUTURE[1]), "not valid before", id="not-yet-valid"),
    pytest.param(lambda keys: keys.issue(features=("reporting",)), "lacks feature 'core'", id="without-core"),
]


@pytest.fixture
async def unlicensed(tmp_path, license_keys: LicenseKeys) -> AsyncIterator[InProcessApp]:
    """certlm's app in this process with no license stored."""
    app = create_app(in_process_settings(tmp_path / "data", license_keys))
    host = app.extensions["certlm"]
    async with app.test_app() as test_app:
        yield InProcessApp(test_app.test_client(), {"X-API-Key": host.api_key}, host)


async def post_raw(app: InProcessApp, body: bytes) -> tuple[int, dict]:
    response = await app.client.post(
        "/systeminfo/lic", data=body, headers={**app.headers, "Content-Type": "application/json"}
    )
    return response.status_code, await response.get_json()


async def test_no_license_stored(unlicensed) -> None:
    assert await unlicensed.call("GET", "/systeminfo/lic") == (404, {"error": "No license stored"})


async def test_install_show_and_remove(unlicensed, license_keys: LicenseKeys) -> None:
    license_b64 = license_keys.issue(endpoints=25, company="Werk Süd AG", license_type="trial")
    assert (await unlicensed.call("GET", "/gds/systeminfo"))[0] == 403
    status, body = await unlicensed.call("POST", "/systeminfo/lic", {"license_b64": license_b64})
    assert status == 201
    assert body["validation_success"] is True and body["validation_message"] is None
    assert body["company"] == "Werk Süd AG"
    assert body["features"] == ["core"] and body["feature_count"] == 1
    assert body["licensed_endpoints"] == 25
    assert body["license_type"] == "trial" and body["product"] == "certlm"
    assert body["is_currently_valid"] is True and body["is_expired"] is False
    assert body["days_until_expiry"] == 365
    assert body["licensed_endpoints_in_use"] == 0
    assert (await unlicensed.call("GET", "/gds/systeminfo"))[0] == 200
    assert await unlicensed.call("GET", "/systeminfo/lic") == (200, body)
    assert await unlicensed.call("DELETE", "/systeminfo/lic") == (
        200,
        {"validation_success": False, "validation_message": "License removed", "features": []},
    )
    assert (await unlicensed.call("GET", "/gds/systeminfo"))[0] == 403
    assert (await unlicensed.call("GET", "/systeminfo/lic"))[0] == 404


async def test_the_license_says_how_many_endpoints_are_in_use(in_process) -> None:
    """An extension for the dashboard: ``licensed_endpoints_in_use`` against ``licensed_endpoints``."""
    rows = [{"server": f"10.0.0.{n}"} for n in (1, 2, 3)] + [{"server": "10.0.0.4", "device_status": 2}]
    status, body = await in_process.call("POST", "/gds/inventory/import", rows)
    assert status == 200, body
    status, body = await in_process.call("GET", "/systeminfo/lic")
    assert status == 200
    assert body["licensed_endpoints_in_use"] == 3 and body["licensed_endpoints"] == 1000


@pytest.mark.parametrize("make_license, message", WRONG_FILES)
async def test_without_a_license_in_force_a_bad_license_is_stored_with_its_reason(
    unlicensed, license_keys, make_license, message
) -> None:
    # The spec's move from "no license": stored and validated at once, the result returned.
    status, body = await unlicensed.call("POST", "/systeminfo/lic", {"license_b64": make_license(license_keys)})
    assert status == 201
    assert body["validation_success"] is False
    assert message in body["validation_message"]
    assert_is_a_sentence(body["validation_message"])
    assert (await unlicensed.call("GET", "/systeminfo/lic"))[1]["validation_message"] == body["validation_message"]
    status, gated = await unlicensed.call("GET", "/gds/systeminfo")
    assert status == 403
    assert gated == {"error": f"no valid license: {body['validation_message']}; install one with POST /systeminfo/lic"}


@pytest.mark.parametrize("make_license, message", WRONG_FILES)
async def test_wrong_file_never_replaces_the_license_in_force(in_process, license_keys, make_license, message) -> None:
    in_force = (await in_process.call("GET", "/systeminfo/lic"))[1]
    status, body = await in_process.call("POST", "/systeminfo/lic", {"license_b64": make_license(license_keys)})
    assert status == 409
    assert body["error"].startswith("license refused, nothing changed: ")
    assert message in body["error"]
    assert body["error"].endswith(
        f"The license in force stays: the commercial license of 'Test Plant GmbH', "
        f"valid from {in_force['validity_start']} to {in_force['validity_end']}."
    )
    assert message in body["refused_license"]["validation_message"]
    # The refusal describes the license; how many endpoints are in use is GET's extension.
    assert body["license_in_force"] == {k: v for k, v in in_force.items() if k != "licensed_endpoints_in_use"}
    assert await in_process.call("GET", "/systeminfo/lic") == (200, in_force)
    assert (await in_process.call("GET", "/gds/systeminfo"))[0] == 200


async def test_valid_license_replaces_the_license_in_force_and_the_log_says_which(
    in_process, license_keys, caplog
) -> None:
    caplog.set_level(logging.WARNING, logger="certlm.licensing")
    renewal = license_keys.issue(company="Werk Nord AG", endpoints=50)
    status, body = await in_process.call("POST", "/systeminfo/lic", {"license_b64": renewal})
    assert status == 201 and body["validation_success"] is True
    assert (await in_process.call("GET", "/systeminfo/lic"))[1]["company"] == "Werk Nord AG"
    assert "license replaced: the commercial license of 'Test Plant GmbH'" in caplog.text
    assert "by the commercial license of 'Werk Nord AG'" in caplog.text


async def test_a_license_not_in_force_is_replaced_even_by_one_not_yet_valid(unlicensed, license_keys) -> None:
    # After the license expired, next year's license can be installed ahead of its start: nothing valid is lost.
    expired = license_keys.issue(start=PAST[0], end=PAST[1])
    assert (await unlicensed.call("POST", "/systeminfo/lic", {"license_b64": expired}))[0] == 201
    next_year = license_keys.issue(start=FUTURE[0], end=FUTURE[1], company="Werk Ost AG")
    status, body = await unlicensed.call("POST", "/systeminfo/lic", {"license_b64": next_year})
    assert status == 201
    assert body["company"] == "Werk Ost AG"
    assert body["validation_message"] == f"the license is not valid before {FUTURE[0].isoformat()}"


@pytest.mark.parametrize(
    "body, error",
    [
        ({"license_b64": "not base64 !!"}, "license_b64 is not valid base64"),
        ({"license_b64": "QUJ"}, "license_b64 is not valid base64"),
        ({"license_b64": " \n "}, "license_b64 is not valid base64"),
        ({"license_b64": ""}, "license_b64: String should have at least 1 character"),
        ({"license_b64": "QUJD" * 16_385}, "license_b64: String should have at most 65536 characters"),
        ({"license_b64": 12345}, "license_b64: Input should be a valid string"),
        ({"license_b64": ["QUJD"]}, "license_b64: Input should be a valid string"),
        ({"license_b64": None}, "license_b64: Input should be a valid string"),
        ({}, "license_b64: Field required"),
        ({"license_b64": "QUJD", "extra": 1}, "extra: Extra inputs are not permitted"),
        (["QUJD"], "Input should be a valid dictionary"),
    ],
    ids=[
        "not-base64", "no-padding", "only-whitespace", "empty", "too-long", "number", "list", "null", "missing",
        "extra-field", "not-an-object",
    ],
)  # fmt: skip
async def test_bad_upload_is_refused_and_the_license_in_force_stays(in_process, body, error) -> None:
    in_force = (await in_process.call("GET", "/systeminfo/lic"))[1]
    status, answer = await in_process.call("POST", "/systeminfo/lic", body)
    assert status == 400
    assert error in answer["error"]
    assert await in_process.call("GET", "/systeminfo/lic") == (200, in_force)


@pytest.mark.parametrize(
    "body, status, error",
    [
        (b'{"license_b64": "QUJD\xff"}', 400, "request body is not UTF-8: byte 21 is 0xff"),
        (b'{"license_b64": "' + b"A" * (1024 * 1024) + b'"}', 413, "request body too large"),
        (b'{"license_b64": ', 400, "malformed request body: expected JSON"),
    ],
    ids=["not-utf-8", "huge", "not-json"],
)
async def test_unreadable_body_is_refused_and_the_license_in_force_stays(in_process, body, status, error) -> None:
    in_force = (await in_process.call("GET", "/systeminfo/lic"))[1]
    assert await post_raw(in_process, body) == (status, {"error": error})
    assert await in_process.call("GET", "/systeminfo/lic") == (200, in_force)


async def test_license_endpoints_need_the_key_but_no_license(unlicensed) -> None:
    response = await unlicensed.client.get("/systeminfo/lic")
    assert response.status_code == 401
    assert (await unlicensed.call("GET", "/systeminfo/lic"))[0] == 404
