"""License upload, validation, removal and restore, as the spec states them: a file of valid base64 is stored and
validated at once (a wrong one leaves the service unlicensed, and the answer says so), a dry run tells what an upload
would do without storing it, and the license replaced or removed is kept so that a restore puts it back."""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncIterator
from datetime import date, timedelta

import pytest

from certlm.http.app import create_app
from tests.support import InProcessApp, LicenseKeys, in_process_settings
from tests.test_licensing import assert_is_a_sentence, tampered

PAST = (date.today() - timedelta(days=10), date.today() - timedelta(days=1))
FUTURE = (date.today() + timedelta(days=3), date.today() + timedelta(days=9))
# How answers name the license every licensed test app starts with (``LicenseKeys.issue``'s defaults).
IN_FORCE_DESCRIPTION = "the commercial license of 'Test Plant GmbH', valid from {validity_start} to {validity_end}"
NO_PREVIOUS = "No previous license stored (certlm keeps the license an upload, restore or removal replaces)"

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
    assert body["description"] == (
        f"the trial license of 'Werk Süd AG', valid from {body['validity_start']} to {body['validity_end']}"
    )
    assert (await unlicensed.call("GET", "/gds/systeminfo"))[0] == 200
    assert body["dry_run"] is False and body["service_licensed"] is True and body["replaced_license"] is None
    extensions = ("dry_run", "service_licensed", "replaced_license", "summary")
    shown = {name: value for name, value in body.items() if name not in extensions}
    assert await unlicensed.call("GET", "/systeminfo/lic") == (200, shown)
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
async def test_a_wrong_file_is_stored_as_the_spec_says_and_the_answer_says_the_service_is_unlicensed(
    in_process, license_keys, make_license, message
) -> None:
    in_force = (await in_process.call("GET", "/systeminfo/lic"))[1]
    status, body = await in_process.call("POST", "/systeminfo/lic", {"license_b64": make_license(license_keys)})
    # The spec: a body of valid base64 is stored and validated at once, 201 Lic.
    assert status == 201
    assert body["validation_success"] is False
    assert message in body["validation_message"]
    assert_is_a_sentence(body["validation_message"])
    assert body["dry_run"] is False and body["service_licensed"] is False
    assert in_force["description"] == IN_FORCE_DESCRIPTION.format(**in_force)
    assert body["replaced_license"] == {k: v for k, v in in_force.items() if k != "licensed_endpoints_in_use"}
    assert body["summary"].startswith("Installed ")
    assert f"which is not valid: {body['validation_message']}. The service is now unlicensed: every feature-gated " \
        "request answers 403 until a valid license is installed. " in body["summary"]  # fmt: skip
    assert body["summary"].endswith(
        f"It replaced {IN_FORCE_DESCRIPTION.format(**in_force)}; POST /systeminfo/lic/restore (certlm license restore) "
        "puts it back."
    )
    shown = (await in_process.call("GET", "/systeminfo/lic"))[1]
    assert shown["validation_message"] == body["validation_message"]
    status, gated = await in_process.call("GET", "/gds/systeminfo")
    assert status == 403
    assert gated == {"error": f"no valid license: {body['validation_message']}; install one with POST /systeminfo/lic"}

    # The license it replaced is kept: a restore puts it back, and the wrong file becomes the previous one.
    status, restored = await in_process.call("POST", "/systeminfo/lic/restore")
    assert status == 200
    assert restored["service_licensed"] is True and restored["validation_success"] is True
    assert restored["replaced_license"]["validation_message"] == body["validation_message"]
    assert await in_process.call("GET", "/systeminfo/lic") == (200, in_force)
    assert (await in_process.call("GET", "/gds/systeminfo"))[0] == 200


@pytest.mark.parametrize("make_license, message", WRONG_FILES)
async def test_a_dry_run_tells_what_an_upload_would_do_and_stores_nothing(
    in_process, license_keys, make_license, message
) -> None:
    in_force = (await in_process.call("GET", "/systeminfo/lic"))[1]
    license_b64 = make_license(license_keys)
    status, body = await in_process.call("POST", "/systeminfo/lic?dry_run=true", {"license_b64": license_b64})
    assert status == 200
    assert body["dry_run"] is True and body["service_licensed"] is False
    assert body["validation_success"] is False and message in body["validation_message"]
    assert body["replaced_license"]["description"] == IN_FORCE_DESCRIPTION.format(**in_force)
    assert body["summary"].startswith("Dry run, nothing changed: would install ")
    assert "This would leave the service unlicensed: every feature-gated request would answer 403" in body["summary"]
    assert await in_process.call("GET", "/systeminfo/lic") == (200, in_force)
    assert (await in_process.call("GET", "/gds/systeminfo"))[0] == 200
    # The answer of the upload itself is the same Lic.
    stored = (await in_process.call("POST", "/systeminfo/lic", {"license_b64": license_b64}))[1]
    spec_fields = set(in_force) - {"licensed_endpoints_in_use"}
    assert {k: body[k] for k in spec_fields} == {k: stored[k] for k in spec_fields}


async def test_a_dry_run_of_a_valid_license_says_what_it_would_replace(in_process, license_keys) -> None:
    in_force = (await in_process.call("GET", "/systeminfo/lic"))[1]
    renewal = license_keys.issue(company="Werk Nord AG", endpoints=50, license_type="trial")
    status, body = await in_process.call("POST", "/systeminfo/lic?dry_run=1", {"license_b64": renewal})
    assert status == 200
    assert (body["company"], body["licensed_endpoints"], body["license_type"]) == ("Werk Nord AG", 50, "trial")
    assert body["validation_success"] is True and body["service_licensed"] is True
    assert body["summary"] == (
        f"Dry run, nothing changed: would install the trial license of 'Werk Nord AG', valid from "
        f"{body['validity_start']} to {body['validity_end']}. The service would be licensed. It would replace "
        f"{IN_FORCE_DESCRIPTION.format(**in_force)}."
    )
    assert await in_process.call("GET", "/systeminfo/lic") == (200, in_force)


async def test_a_dry_run_without_a_license_installed_says_so(unlicensed, license_keys) -> None:
    status, body = await unlicensed.call("POST", "/systeminfo/lic?dry_run=on", {"license_b64": license_keys.issue()})
    assert status == 200 and body["service_licensed"] is True and body["replaced_license"] is None
    assert body["summary"].endswith("The service would be licensed. No license is installed now.")
    assert (await unlicensed.call("GET", "/systeminfo/lic"))[0] == 404


async def test_valid_license_replaces_the_license_in_force_and_the_log_says_which(
    in_process, license_keys, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="certlm.system.licensing")
    renewal = license_keys.issue(company="Werk Nord AG", endpoints=50)
    status, body = await in_process.call("POST", "/systeminfo/lic", {"license_b64": renewal})
    assert status == 201 and body["validation_success"] is True and body["service_licensed"] is True
    assert body["replaced_license"]["company"] == "Test Plant GmbH"
    assert (await in_process.call("GET", "/systeminfo/lic"))[1]["company"] == "Werk Nord AG"
    assert (
        f"license installed: the commercial license of 'Werk Nord AG', valid from {body['validity_start']} to "
        f"{body['validity_end']} (valid); it replaced the commercial license of 'Test Plant GmbH'"
    ) in caplog.text


async def test_an_upload_that_leaves_the_service_unlicensed_is_logged_as_a_warning(
    in_process, license_keys, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="certlm.system.licensing")
    await in_process.call("POST", "/systeminfo/lic", {"license_b64": license_keys.issue(features=("reporting",))})
    (record,) = [r for r in caplog.records if r.name == "certlm.system.licensing"]
    assert record.levelno == logging.WARNING
    assert (
        "(not valid: the license lacks feature 'core', which every route but /systeminfo/lic needs; the service is "
        "unlicensed); it replaced the commercial license of 'Test Plant GmbH'"
    ) in record.getMessage()


async def test_restore_swaps_the_license_in_force_and_the_previous_one(in_process, license_keys) -> None:
    first = (await in_process.call("GET", "/systeminfo/lic"))[1]
    second = (await in_process.call("POST", "/systeminfo/lic", {"license_b64": license_keys.issue(company="B")}))[1]
    status, preview = await in_process.call("POST", "/systeminfo/lic/restore?dry_run=true")
    assert status == 200 and preview["dry_run"] is True
    assert preview["company"] == "Test Plant GmbH" and preview["replaced_license"]["company"] == "B"
    assert preview["summary"].startswith("Dry run, nothing changed: would restore the commercial license of")
    assert (await in_process.call("GET", "/systeminfo/lic"))[1]["company"] == "B"

    status, restored = await in_process.call("POST", "/systeminfo/lic/restore")
    assert status == 200 and restored["dry_run"] is False
    assert {k: restored[k] for k in preview if k not in ("dry_run", "summary")} == {
        k: preview[k] for k in preview if k not in ("dry_run", "summary")
    }
    assert restored["summary"].startswith("Restored the commercial license of 'Test Plant GmbH'")
    assert await in_process.call("GET", "/systeminfo/lic") == (200, first)
    # A second restore undoes the first.
    await in_process.call("POST", "/systeminfo/lic/restore")
    assert (await in_process.call("GET", "/systeminfo/lic"))[1]["company"] == second["company"]


async def test_a_removed_license_can_be_restored(in_process) -> None:
    in_force = (await in_process.call("GET", "/systeminfo/lic"))[1]
    assert (await in_process.call("DELETE", "/systeminfo/lic"))[0] == 200
    assert (await in_process.call("GET", "/gds/systeminfo"))[0] == 403
    status, restored = await in_process.call("POST", "/systeminfo/lic/restore")
    assert status == 200 and restored["replaced_license"] is None
    assert restored["summary"].endswith("The service is licensed. No license was installed before.")
    assert await in_process.call("GET", "/systeminfo/lic") == (200, in_force)
    assert (await in_process.call("GET", "/gds/systeminfo"))[0] == 200
    # Nothing is kept now: the restored license was the only one.
    assert await in_process.call("POST", "/systeminfo/lic/restore") == (404, {"error": NO_PREVIOUS})


async def test_installing_the_same_file_again_keeps_the_previous_license(in_process, license_keys) -> None:
    first = (await in_process.call("GET", "/systeminfo/lic"))[1]
    again = license_keys.issue(company="Again")
    await in_process.call("POST", "/systeminfo/lic", {"license_b64": again})
    status, body = await in_process.call("POST", "/systeminfo/lic", {"license_b64": again})
    assert status == 201 and body["summary"].endswith("The same file was installed already.")
    await in_process.call("POST", "/systeminfo/lic/restore")
    assert await in_process.call("GET", "/systeminfo/lic") == (200, first)


async def test_without_a_previous_license_restore_is_404_and_changes_nothing(unlicensed, license_keys) -> None:
    assert await unlicensed.call("POST", "/systeminfo/lic/restore") == (404, {"error": NO_PREVIOUS})
    assert await unlicensed.call("POST", "/systeminfo/lic/restore?dry_run=true") == (404, {"error": NO_PREVIOUS})
    await unlicensed.call("POST", "/systeminfo/lic", {"license_b64": license_keys.issue()})
    assert await unlicensed.call("POST", "/systeminfo/lic/restore") == (404, {"error": NO_PREVIOUS})
    assert (await unlicensed.call("GET", "/systeminfo/lic"))[1]["validation_success"] is True


@pytest.mark.parametrize("path", ["/systeminfo/lic", "/systeminfo/lic/restore"])
@pytest.mark.parametrize("value", ["maybe", "", "2", "-1", "truee", "null", "ja", "\u0661"])
async def test_a_bad_dry_run_value_is_400_and_changes_nothing(in_process, license_keys, path, value) -> None:
    in_force = (await in_process.call("GET", "/systeminfo/lic"))[1]
    await in_process.call("POST", "/systeminfo/lic", {"license_b64": license_keys.issue(company="Next")})
    response = await in_process.client.post(
        path, query_string={"dry_run": value}, json={"license_b64": license_keys.issue(company="Other")},
        headers=in_process.headers,
    )  # fmt: skip
    assert response.status_code == 400
    assert (await response.get_json())["error"].startswith("dry_run: Input should be a valid boolean")
    assert (await in_process.call("GET", "/systeminfo/lic"))[1]["company"] == "Next"
    await in_process.call("POST", "/systeminfo/lic/restore")
    assert await in_process.call("GET", "/systeminfo/lic") == (200, in_force)


async def test_openapi_documents_the_dry_run_the_restore_and_the_extensions(unlicensed) -> None:
    response = await unlicensed.client.get("/openapi.json")
    document = await response.get_json()
    upload = document["paths"]["/systeminfo/lic"]["post"]
    (parameter,) = upload["parameters"]
    assert (parameter["name"], parameter["in"], parameter["schema"]["type"]) == ("dry_run", "query", "boolean")
    assert {"200", "201", "400"} <= set(upload["responses"])
    restore = document["paths"]["/systeminfo/lic/restore"]["post"]
    assert [p["name"] for p in restore["parameters"]] == ["dry_run"]
    assert {"200", "404"} <= set(restore["responses"])
    # It needs the key but no license: a 403 is only a named key's role falling short of admin's.
    assert restore["x-certlm-role"] == "admin"
    assert "license" not in restore["responses"]["403"]["description"], restore["responses"]["403"]
    schema = upload["responses"]["201"]["content"]["application/json"]["schema"]["properties"]
    for extension in ("description", "dry_run", "service_licensed", "replaced_license", "summary"):
        assert schema[extension]["description"].startswith("extension: "), extension


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


async def test_install_remove_and_restore_on_both_storage_engines(make_service, database_url, license_keys) -> None:
    """The installed and the previous license are two rows of one table, changed in one transaction each."""
    service = await make_service(database_url=database_url)
    async with service.client() as api:
        in_force = (await api.get("/systeminfo/lic")).json()
        wrong = await api.post("/systeminfo/lic", json={"license_b64": license_keys.issue(features=("reporting",))})
        assert wrong.status_code == 201 and wrong.json()["service_licensed"] is False
        assert (await api.get("/gds/systeminfo")).status_code == 403
        assert (await api.post("/systeminfo/lic/restore")).status_code == 200
        assert (await api.get("/systeminfo/lic")).json() == in_force
        assert (await api.delete("/systeminfo/lic")).status_code == 200
        restored = (await api.post("/systeminfo/lic/restore")).json()
        assert restored["company"] == in_force["company"] and restored["replaced_license"] is None
        assert (await api.get("/gds/systeminfo")).status_code == 200
