"""The REST device contract published as an OpenAPI document (``certlm_rest/device-api.yaml``): it is valid OpenAPI
3.1, the README's table names its operations, the plugin's test device answers as it documents (property-based with
schemathesis, and every operation in turn), and the generic driver onboards and renews a device built from the
document alone (``contract_device.py``), whose checks of every request certlm sends are the independent reference."""

from __future__ import annotations

import asyncio
import base64
import copy
import re
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import schemathesis
from cryptography import x509
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from certlm.foundation.certs import issued_by, to_der
from certlm.lifecycle.renewal import renewal_scan
from certlm.lifecycle.schedulers import ScanContext
from certlm.lifecycle.suppression import MaintenanceCalendar
from certlm.storage.models import InventoryEntry
from certlm.system.settings import system_settings
from tests.crypto_factory import make_ca, pem
from tests.plugins.rest.contract import BASE_PATH, device_api, operation, operations
from tests.plugins.rest.contract_device import APPLICATION_URI, KEY_BITS, ContractDevice
from tests.plugins.rest.device import RestTestDevice
from tests.plugins.rest.test_push import failed_push, push, steps
from tests.support import InProcessApp

README = Path(__file__).parents[3] / "plugins" / "rest" / "README.md"
BASIC_ADMIN = "Basic " + base64.b64encode(b"admin:admin-pw").decode()


def test_the_document_is_valid_openapi_3() -> None:
    document = device_api()
    assert document["openapi"].startswith("3.")
    schemathesis.openapi.from_dict(document).validate()
    # The validation really runs: a broken copy is refused.
    broken = copy.deepcopy(document)
    broken["paths"]["/device"]["get"]["responses"] = "none"
    with pytest.raises(Exception, match="responses"):
        schemathesis.openapi.from_dict(broken).validate()


def test_every_operation_is_named_and_answers_401_and_no_yaml_slip_left_a_null() -> None:
    def nulls(node: Any, where: str) -> Iterator[str]:
        if node is None:
            yield where
        elif isinstance(node, dict):
            for key, value in node.items():
                yield from nulls(value, f"{where}/{key}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                yield from nulls(value, f"{where}/{index}")

    assert list(nulls(device_api(), "")) == []
    assert len(operations()) == 9
    assert len({op.operation_id for op in operations()}) == 9
    for op in operations():
        assert "401" in op.spec["responses"], op


def test_the_readme_table_lists_exactly_the_documents_operations() -> None:
    table = set(re.findall(r"^\| `(GET|POST|PUT|DELETE) (/[a-z-]+)`", README.read_text(), flags=re.MULTILINE))
    assert table == {(op.method, op.path) for op in operations()}


def test_the_contract_is_shipped_as_package_data() -> None:
    pyproject = (README.parent / "pyproject.toml").read_text()
    assert re.search(r'certlm_rest = \[[^\]]*"device-api\.yaml"', pyproject), pyproject


# The plugin's test device against the document, as schemathesis generates requests from it. The device runs on an
# event loop of its own thread: schemathesis calls it synchronously.


@pytest.fixture(scope="module")
def threaded_device(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestTestDevice]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="rest-test-device", daemon=True)
    thread.start()
    device = RestTestDevice(tmp_path_factory.mktemp("threaded-device"))
    try:
        asyncio.run_coroutine_threadsafe(device.start(), loop).result(30)
        yield device
    finally:
        asyncio.run_coroutine_threadsafe(device.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


SCHEMA = schemathesis.openapi.from_dict(device_api())


@SCHEMA.parametrize()
@settings(max_examples=20, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_the_test_device_answers_as_the_document_says(case: Any, threaded_device: RestTestDevice) -> None:
    case.call_and_validate(
        base_url=f"https://{threaded_device.host}{BASE_PATH}",
        headers={"Authorization": BASIC_ADMIN},
        verify=str(threaded_device.directory / "tls.pem"),
        timeout=30,
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
            negative_data_rejection,
        ],
    )


class Caller:
    """Calls the test device's generic API and checks each answer against the document."""

    def __init__(self, session: aiohttp.ClientSession, device: RestTestDevice) -> None:
        self.session, self.device = session, device
        self.checked: set[str] = set()

    async def __call__(
        self, method: str, path: str, body: Any = None, *, expect: int, authorization: str | None = BASIC_ADMIN
    ) -> Any:
        headers = {"Authorization": authorization} if authorization else {}
        async with self.session.request(
            method, f"https://{self.device.host}{BASE_PATH}{path}", json=body, headers=headers, ssl=False
        ) as response:
            raw = await response.read()
            content_type = response.content_type if raw else None
            errors = operation(method, path).answer_errors(response.status, content_type, raw)
            assert not errors, errors
            assert response.status == expect, (method, path, response.status, raw)
            self.checked.add(f"{method} {path} {response.status}")
            return await response.json() if raw else None


async def test_every_operation_of_the_test_device_in_turn_conforms(rest_device: Any) -> None:
    device: RestTestDevice = await rest_device()
    factory = device.active.certificate
    ca = make_ca("Contract test CA")
    async with aiohttp.ClientSession() as session:
        call = Caller(session, device)
        for op in operations():
            await call(op.method, op.path, expect=401, authorization=None)
        await call("GET", "/device", expect=401, authorization="Bearer not-the-token")
        await call("GET", "/device", expect=401, authorization="Basic " + base64.b64encode(b"admin:no").decode())
        identity = await call("GET", "/device", expect=200)
        assert identity["state"] == "running" and identity["key_generation"] is True
        await call("POST", "/rollback", expect=409)  # nothing applied yet
        await call("POST", "/apply", expect=409)  # nothing staged
        await call("DELETE", "/pending", expect=204)  # nothing staged: still 204
        await call("PUT", "/certificate", {"certificate": pem(ca.certificate), "chain": []}, expect=409)  # no CSR
        await call("POST", "/csr", {"subject": "not a DN"}, expect=400)
        await call("POST", "/csr", {}, expect=400)
        device.makes_keys = False
        await call("POST", "/csr", {"subject": None}, expect=501)
        device.makes_keys = True
        answer = await call("POST", "/csr", {"subject": "CN=press 7"}, expect=200)
        csr = x509.load_pem_x509_csr(answer["csr"].encode())
        assert csr.public_key().key_size == 2048 and csr.subject.rfc4514_string() == "CN=press 7"
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert "urn:certlm-tests:rest-device" in san.get_values_for_type(x509.UniformResourceIdentifier)
        await call("PUT", "/certificate", {"certificate": pem(ca.certificate), "chain": []}, expect=400)  # key
        await call("PUT", "/certificate", {"certificate": "-----BEGIN CERTIFICATE-----x", "chain": []}, expect=400)
        issued = ca.sign_request(csr)
        await call("PUT", "/certificate", {"certificate": pem(issued), "chain": []}, expect=204)
        await call("PUT", "/trust-list", {"trusted_certificates": [pem(ca.certificate)], "trusted_crls": [
            pem(ca.crl())]}, expect=204)  # fmt: skip
        await call("PUT", "/trust-list", {"trusted_certificates": ["x"], "trusted_crls": []}, expect=400)
        assert (await call("POST", "/apply", expect=200)) == {"state": "running"}
        installed = await call("GET", "/certificate", expect=200)
        assert installed["certificate"] == pem(issued)
        trust = await call("GET", "/trust-list", expect=200)
        assert trust["trusted_certificates"] == [pem(ca.certificate)] and len(trust["trusted_crls"]) == 1
        await call("PUT", "/certificate", {"certificate": pem(issued), "chain": []}, expect=409)  # key used up
        assert (await call("POST", "/rollback", expect=200)) == {"state": "running"}
        assert (await call("GET", "/certificate", expect=200))["certificate"] == pem(factory)
        await call("POST", "/rollback", expect=409)  # one generation only
        device.faults.fail_apply = True
        await call("PUT", "/trust-list", {"trusted_certificates": [], "trusted_crls": []}, expect=204)
        await call("POST", "/apply", expect=500)
        assert (await call("GET", "/device", expect=200))["state"] == "error"
        await call("POST", "/rollback", expect=200)
    documented = {f"{op} {status}" for op in operations() for status in op.spec["responses"]}
    # Every documented answer was given and checked, but those the test device never gives: 403 (it has no rights),
    # 413 (no size limit), a failed rollback (its rollback always brings the server back).
    never = {f"{op} 403" for op in operations()} | {"PUT /trust-list 413", "POST /rollback 500"}
    assert documented - call.checked == never


# The generic driver against a device built from the document.


async def register_contract_device(certlm: InProcessApp, device: ContractDevice, pki_id: int, basic: bool) -> dict:
    credentials = (
        {"userinfo_name": "operator", "userinfo_password": "operator-pw"} if basic
        else {"bearer_token": device.bearer_token}
    )  # fmt: skip
    status, entry = await certlm.call(
        "POST", "/rest/inventory", {"server": "127.0.0.1", "port": device.port, "pki": pki_id, **credentials}
    )
    assert status == 200, entry
    return entry


async def renew_by_scheduler(certlm: InProcessApp, device: ContractDevice) -> dict[str, Any]:
    """The renewal scheduler's scan, half a day before the device's certificate (renewal_days 1) expires; the
    entry's last results."""
    async with certlm.context():
        await InventoryEntry.filter(port=device.port).update(renewal_days=1)
        future = device.active.certificate.not_valid_after_utc - timedelta(hours=12)
        context = ScanContext(
            future, await MaintenanceCalendar.load(), timedelta(hours=1), lambda: future, await system_settings()
        )
        report = await renewal_scan(certlm.host.runtime, context)
        assert report.outcomes.get("renewed") == 1, report
        return (await InventoryEntry.get(port=device.port)).last_result


@pytest.mark.parametrize(("basic", "key_generation"), [(False, True), (True, True), (False, False)],
                         ids=["bearer-device-keys", "basic-device-keys", "bearer-certlm-key"])  # fmt: skip
async def test_the_generic_driver_onboards_and_renews_a_device_built_from_the_document(
    certlm: InProcessApp, contract_device: Any, pki_id: int, basic: bool, key_generation: bool
) -> None:
    device: ContractDevice = await contract_device(key_generation=key_generation)
    own = (device.active.trusted_certificates, device.active.trusted_crls, device.active.issuer_certificates)
    entry = await register_contract_device(certlm, device, pki_id, basic)
    assert entry["service"] == "rest-generic" and entry["warnings"] == [], entry
    assert base64.b64decode(entry["cert_base64"]) == to_der(device.factory.certificate)

    outcome = await push(certlm, device, onboarding=True)  # type: ignore[arg-type]
    assert outcome["success"], outcome
    onboarded = device.active.certificate
    assert onboarded != device.factory.certificate and device.previous is device.factory
    answer = await certlm.client.get(f"/pki/ca/{pki_id}", query_string={"format": "der"}, headers=certlm.headers)
    ca = x509.load_der_x509_certificate(await answer.get_data())
    assert issued_by(onboarded, ca) and device.active.chain == ()  # the root issued it: no chain
    san = onboarded.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert APPLICATION_URI in san.get_values_for_type(x509.UniformResourceIdentifier)
    assert onboarded.public_key().key_size == (KEY_BITS if key_generation else 2048)
    # The device's own trusted certificates, CRLs and issuer list are still there, next to certlm's CA.
    assert set(own[0]) < set(device.active.trusted_certificates) and ca in device.active.trusted_certificates
    assert set(map(to_der, own[1])) <= {to_der(c) for c in device.active.trusted_crls}
    assert device.active.issuer_certificates == own[2]

    last = await renew_by_scheduler(certlm, device)
    renewed = device.active.certificate
    assert renewed != onboarded and device.previous is not None and device.previous.certificate == onboarded
    assert last["push"]["result"]["trigger"] == "scheduler", last
    assert set(own[0]) < set(device.active.trusted_certificates)

    assert device.violations == []  # every request certlm sent is one the document describes
    used = set(device.called)
    expected = {"getDevice", "getCertificate", "getTrustList", "putTrustList", "putCertificate", "apply"}
    assert expected <= used and ("createCsr" in used) == key_generation, used


async def test_a_failed_apply_on_the_device_built_from_the_document_is_rolled_back(
    certlm: InProcessApp, contract_device: Any, pki_id: int
) -> None:
    device: ContractDevice = await contract_device()
    await register_contract_device(certlm, device, pki_id, basic=False)
    outcome = await push(certlm, device, onboarding=True)  # type: ignore[arg-type]
    assert outcome["success"], outcome
    onboarded = device.active
    device.fail_next_apply = True
    failure = await failed_push(certlm, device, automated=True, trigger="scheduler")  # type: ignore[arg-type]
    result = failure.details["result"]
    assert steps(result)["apply"] is False and steps(result)["rollback"] is True, result
    assert result["device_changed"] is False and device.active is onboarded and device.previous is None
    assert device.violations == []
