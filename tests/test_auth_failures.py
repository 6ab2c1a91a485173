"""Failed authentication is logged with its source address and limited per source: wrong API keys, and wrong TOTP
codes of ``DELETE /sql``, are answered 429 with ``Retry-After`` once an address failed too often within the window;
other addresses, the open routes and the spec's 401 texts are unaffected."""

from __future__ import annotations

import base64
import re
import time
from pathlib import Path

import httpx
import pyotp
import pytest
from quart import Quart

from certlm.foundation.config import Settings
from certlm.http.auth import API_KEY, FailureLimiter, TooManyFailures, is_open, request_source
from tests.support import RunningService, eventually

LIMIT = 3
WRONG_KEY = "a-wrong-key-that-must-never-be-logged"
INVALID_TOTP = {"error": "Invalid TOTP code"}


def from_address(service: RunningService, address: str, api_key: str | bool | None = True) -> httpx.AsyncClient:
    """A client of ``service`` whose connections come from ``address`` (any of 127.0.0.0/8 reaches 127.0.0.1)."""
    return service.client(api_key=api_key, transport=httpx.AsyncHTTPTransport(local_address=address))


def log_lines(service: RunningService, level: str) -> list[str]:
    """The service's log file lines at ``level`` (the file alone: the console repeats them)."""
    text = (service.data_dir / "logs" / "certlm.log").read_text()
    return [line for line in text.splitlines() if f" {level} " in line]


def totp(api_key: str) -> pyotp.TOTP:
    return pyotp.TOTP(base64.b32encode(api_key.encode()).decode().rstrip("="))


def totp_code(api_key: str) -> str:
    return totp(api_key).now()


def wrong_codes(api_key: str, count: int) -> list[str]:
    accepted = {totp(api_key).at(time.time(), counter_offset=offset) for offset in (-1, 0, 1)}
    return [code for code in (f"{n:06d}" for n in range(count + 3)) if code not in accepted][:count]


def assert_too_many(response: httpx.Response, credential: str, window_s: int) -> None:
    assert response.status_code == 429, response.text
    retry_after = int(response.headers["Retry-After"])
    assert 1 <= retry_after <= window_s
    assert response.json() == {
        "error": f"too many failed attempts at the {credential} from this address: try again in {retry_after} s"
    }


@pytest.fixture
async def limited(make_service) -> RunningService:
    return await make_service(env={"CERTLM_AUTH_FAILURE_LIMIT": str(LIMIT), "CERTLM_AUTH_FAILURE_WINDOW_S": "600"})


async def test_wrong_keys_from_one_address_are_refused_after_the_limit(limited: RunningService) -> None:
    async with (
        from_address(limited, "127.0.0.2", WRONG_KEY) as guesser,
        from_address(limited, "127.0.0.2") as guesser_with_the_key,
        from_address(limited, "127.0.0.3") as operator,
        from_address(limited, "127.0.0.4", api_key=None) as anonymous,
    ):
        for forged in ({"Remote-Addr": "198.51.100.1"}, {"X-Forwarded-For": "198.51.100.2"})[: LIMIT - 1]:
            # What a client says about its address is not believed: the connection's address counts.
            response = await guesser.get("/gds/systeminfo", headers=forged)
            assert response.status_code == 401 and response.json() == {"error": "invalid API key"}
        # Another address's success resets nothing of this one's failures.
        assert (await operator.get("/gds/systeminfo")).status_code == 200
        assert (await guesser.get("/inventory")).status_code == 401
        # Now refused whatever it sends, the right key included, on every route that needs the key.
        for client, path in ((guesser, "/inventory"), (guesser_with_the_key, "/gds/systeminfo"),
                             (guesser_with_the_key, "/sql/123456")):  # fmt: skip
            assert_too_many(await client.request("DELETE" if path.startswith("/sql") else "GET", path), API_KEY, 600)
        # The open routes stay open to it; other addresses are not affected.
        assert (await guesser.get("/systeminfo")).status_code == 200
        assert (await operator.get("/gds/systeminfo")).status_code == 200
        # Requests without a key are refused (the spec's 401) and logged, but they guess nothing: not counted.
        for _ in range(2 * LIMIT):
            response = await anonymous.get("/inventory")
            assert response.status_code == 401 and response.json()["error"].startswith("missing API key")
        for _ in range(20):  # hammering on
            assert (await guesser.get("/inventory")).status_code == 429

    warnings = [line for line in log_lines(limited, "WARNING") if "certlm.http.auth" in line]
    assert any("refused GET /gds/systeminfo from 127.0.0.2: invalid API key" in line for line in warnings)
    assert any(f"{LIMIT} failed attempts at the API key from 127.0.0.2" in line for line in warnings)
    assert any("refused GET /inventory from 127.0.0.4: missing API key" in line for line in warnings)
    # Once per source and window, however hard it hammers; never the key tried.
    assert len([line for line in warnings if "127.0.0.2" in line]) == 2
    assert len([line for line in warnings if "127.0.0.4" in line]) == 1
    assert WRONG_KEY not in limited.log()


async def test_an_address_may_try_again_when_its_window_ends(make_service) -> None:
    service = await make_service(env={"CERTLM_AUTH_FAILURE_LIMIT": "1", "CERTLM_AUTH_FAILURE_WINDOW_S": "2"})
    async with service.client(api_key=WRONG_KEY) as guesser, service.client() as operator:
        assert (await guesser.get("/inventory")).status_code == 401
        assert_too_many(await operator.get("/inventory"), API_KEY, 2)

        async def let_in() -> bool:
            return (await operator.get("/inventory")).status_code == 200

        await eventually(let_in, "the address let in again after its window", timeout=10)


async def test_wrong_totp_codes_are_refused_after_the_limit(limited: RunningService) -> None:
    async with from_address(limited, "127.0.0.2") as guesser, from_address(limited, "127.0.0.3") as operator:
        assert (await guesser.post("/gds/inventory", json={"server": "kept.plant.invalid"})).status_code == 200
        # Malformed codes cannot be right: refused with the spec's 401, not counted.
        for code in ("abcdef", "12345", "1234567"):
            response = await guesser.delete(f"/sql/{code}")
            assert response.status_code == 401 and response.json() == INVALID_TOTP
        for code in wrong_codes(limited.api_key, LIMIT):
            response = await guesser.delete(f"/sql/{code}")
            assert response.status_code == 401 and response.json() == INVALID_TOTP
        assert_too_many(await guesser.delete(f"/sql/{totp_code(limited.api_key)}"), "TOTP code", 600)
        assert [entry["server"] for entry in (await guesser.get("/gds/inventory")).json()] == ["kept.plant.invalid"]
        # The API key of that address is not blocked by its TOTP failures; another address's codes count apart.
        assert (await guesser.get("/gds/systeminfo")).status_code == 200
        response = await operator.delete(f"/sql/{wrong_codes(limited.api_key, 1)[0]}")
        assert response.status_code == 401 and response.json() == INVALID_TOTP
        assert (await operator.delete(f"/sql/{totp_code(limited.api_key)}")).status_code == 200
    warnings = [line for line in log_lines(limited, "WARNING") if "certlm.http.auth" in line]
    assert any("refused DELETE /sql/<totp_code> from 127.0.0.2: malformed TOTP code" in line for line in warnings)
    assert any(f"{LIMIT} failed attempts at the TOTP code from 127.0.0.2" in line for line in warnings)
    assert not re.search(r"/sql/[0-9]", limited.log()), "a code tried was logged"


async def test_429_is_documented_wherever_the_key_is_checked(service: RunningService) -> None:
    async with service.client(api_key=None) as anonymous:
        document = (await anonymous.get("/openapi.json")).json()
    for path, item in document["paths"].items():
        rule = re.sub(r"\{([a-z_]+)\}", r"<\1>", path).replace("<host_or_url>", "<path:host_or_url>")
        for method, operation in item.items():
            response = operation["responses"].get("429")
            if is_open(method.upper(), rule):
                assert response is None, (method, path)
            else:
                assert response is not None, (method, path)
                assert response["headers"]["Retry-After"]["schema"] == {"type": "integer"}
                assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}


def test_the_limiter_remembers_a_bounded_number_of_addresses() -> None:
    now = [0.0]
    limiter = FailureLimiter(API_KEY, limit=2, window_s=60, max_sources=100, clock=lambda: now[0])
    limiter.refused("192.0.2.1", "GET /inventory", "invalid API key")
    limiter.refused("192.0.2.1", "GET /inventory", "invalid API key")
    with pytest.raises(TooManyFailures):
        limiter.check("192.0.2.1")
    # A flood of addresses: the oldest windows are forgotten first, the memory stays bounded.
    for number in range(5000):
        now[0] += 0.001
        limiter.refused(f"10.{number // 65536}.{number // 256 % 256}.{number % 256}", "GET /x", "invalid API key")
        assert len(limiter) <= 100
    limiter.check("192.0.2.1")  # forgotten
    # Windows that ended are dropped as new addresses come.
    now[0] += 61
    limiter.refused("198.51.100.7", "GET /x", "invalid API key")
    assert len(limiter) == 1


async def test_ipv6_addresses_count_per_64_block(tmp_path: Path) -> None:
    app = Quart(__name__)
    sources = {}
    for address in ("2001:db8:1:2::1", "2001:db8:1:2:ffff::9", "2001:db8:1:3::1", "::ffff:192.0.2.5", "192.0.2.5"):
        # As Quart's ASGI layer hands the connection's address over.
        async with app.test_request_context("/", headers={"Remote-Addr": address}):
            sources[address] = request_source()
    assert sources == {
        "2001:db8:1:2::1": "2001:db8:1:2::/64",
        "2001:db8:1:2:ffff::9": "2001:db8:1:2::/64",
        "2001:db8:1:3::1": "2001:db8:1:3::/64",
        "::ffff:192.0.2.5": "192.0.2.5",
        "192.0.2.5": "192.0.2.5",
    }


def test_failure_limit_settings(tmp_path: Path) -> None:
    defaults = Settings.from_env({}, data_dir=tmp_path)
    assert (defaults.auth_failure_limit, defaults.auth_failure_window_s) == (10, 300.0)
    env = {"CERTLM_AUTH_FAILURE_LIMIT": "25", "CERTLM_AUTH_FAILURE_WINDOW_S": "900"}
    settings = Settings.from_env(env, data_dir=tmp_path)
    assert (settings.auth_failure_limit, settings.auth_failure_window_s) == (25, 900.0)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("CERTLM_AUTH_FAILURE_LIMIT", "0"),
        ("CERTLM_AUTH_FAILURE_LIMIT", "-3"),
        ("CERTLM_AUTH_FAILURE_LIMIT", "ten"),
        ("CERTLM_AUTH_FAILURE_LIMIT", "100001"),
        ("CERTLM_AUTH_FAILURE_LIMIT", "\u0661\u0660"),  # Arabic-Indic digits
        ("CERTLM_AUTH_FAILURE_WINDOW_S", "0"),
        ("CERTLM_AUTH_FAILURE_WINDOW_S", "nan"),
        ("CERTLM_AUTH_FAILURE_WINDOW_S", "five minutes"),
        ("CERTLM_AUTH_FAILURE_WINDOW_S", str(24 * 3600 + 1)),
    ],
)
def test_a_bad_failure_limit_setting_stops_start_up_naming_it(tmp_path: Path, name: str, value: str) -> None:
    with pytest.raises(ValueError, match=name):
        Settings.from_env({name: value}, data_dir=tmp_path)
