"""Bulk registration (``certlm.inventory.importing``) through ``POST /gds/inventory/import``: JSON and CSV, the atomic
and per-row modes, per-row results, the license limit, and every bad file refused with nothing stored."""

from __future__ import annotations

import json
import uuid

import pytest

from certlm.inventory.importing import MAX_IMPORT_ROWS, parse_import

CSV = {"Content-Type": "text/csv"}


def hosts(count: int) -> list[str]:
    prefix = uuid.uuid4().hex[:8]
    return [f"plc-{prefix}-{n}.plant.local" for n in range(count)]


async def gds_count(api) -> int:
    await api.post("/systeminfo", json={"show_inactive_devices": True})
    return len((await api.get("/gds/inventory")).json())


async def test_a_json_import_registers_every_row_and_reports_each(api) -> None:
    first, second, third = hosts(3)
    rows = [{"server": first.upper(), "port": 4841, "name": "Press 1"}, {"server": second},
            {"server": third, "device_status": 0, "userinfo_name": "op", "userinfo_password": "pw"}]  # fmt: skip
    response = await api.post("/gds/inventory/import", json=rows)
    assert response.status_code == 200, response.text
    result = response.json()
    assert (result["mode"], result["imported"], result["failed"]) == ("atomic", 3, 0)
    assert [(row["row"], row["address"], row["ok"]) for row in result["rows"]] == [
        (1, f"{first}:4841", True), (2, f"{second}:4840", True), (3, f"{third}:4840", True)
    ]  # fmt: skip
    stored = (await api.get(f"/gds/inventory/{first.upper()}:4841")).json()
    assert (stored["id"], stored["name"], stored["server"]) == (result["rows"][0]["id"], "Press 1", first)
    assert (await api.get(f"/gds/inventory/{third}")).json()["username"] == "op"


async def test_per_row_mode_stores_the_good_rows_and_names_what_is_wrong_with_the_others(api) -> None:
    known, good, twice, other = hosts(4)
    await api.post("/gds/inventory", json={"server": known, "port": 1})
    csv = (f"server,port,name,pki\n{good},1,Good,\n{known},1,Known,\n{twice},2,,\n{twice},2,,\n{other},abc,,\n"
           f"{other},3,,999999\n")  # fmt: skip
    response = await api.post("/gds/inventory/import?mode=per_row", content=csv, headers=CSV)
    assert response.status_code == 200, response.text
    result = response.json()
    assert (result["mode"], result["imported"], result["failed"]) == ("per_row", 2, 4)
    by_row = {row["row"]: row for row in result["rows"]}
    assert by_row[1]["ok"] and by_row[3]["ok"]
    assert by_row[2]["error"].startswith(f"gds inventory already has {known}:1 (id ")
    assert by_row[4]["error"] == f"{twice}:2 is also row 3"
    assert by_row[5]["address"] == f"{other}:abc" and "port" in by_row[5]["error"]
    assert by_row[6]["error"] == "pki: no PKI entry with id 999999"
    assert (await api.get(f"/gds/inventory/{good}:1")).json()["name"] == "Good"
    assert (await api.get(f"/gds/inventory/{other}")).status_code == 404


async def test_an_atomic_import_with_a_refused_row_stores_nothing(api) -> None:
    good, bad = hosts(2)
    before = await gds_count(api)
    response = await api.post("/gds/inventory/import", json=[{"server": good}, {"server": bad, "port": "4840"}])
    assert response.status_code == 400
    body = response.json()
    assert body["error"] == "1 of 2 rows refused: nothing imported"
    assert [row["ok"] for row in body["rows"]] == [True, False] and body["imported"] == 0
    assert await gds_count(api) == before


async def test_the_license_limit_holds_for_imports(make_service, license_keys) -> None:
    service = await make_service(licensed=False)
    await service.install_license(license_keys.issue(endpoints=3))
    async with service.client() as api:
        await api.post("/gds/inventory", json={"server": "plc-0.plant.local", "port": 1})
        rows = [{"server": server, "port": 1} for server in hosts(3)]
        refused = await api.post("/gds/inventory/import", json=rows)
        assert refused.status_code == 403
        assert refused.json()["error"] == (
            "license endpoint limit reached: 3 endpoints licensed, 2 free, the import adds 3: nothing imported"
        )
        assert await gds_count(api) == 1
        # A deleted entry does not count; per row, the rows beyond the limit are refused.
        rows.append({"server": "plc-deleted.plant.local", "port": 1, "device_status": 2})
        result = (await api.post("/gds/inventory/import?mode=per_row", json=rows)).json()
        assert [row["ok"] for row in result["rows"]] == [True, True, False, True]
        assert result["rows"][2]["error"] == "license endpoint limit reached: 3 endpoints licensed"
        assert await gds_count(api) == 4


TOO_MANY = "server\n" + "".join(f"plc-{n}.plant.local\n" for n in range(MAX_IMPORT_ROWS + 1))


async def test_a_csv_import_registers_its_rows_as_post_would(api) -> None:
    first, second = hosts(2)
    csv = f'\ufeffserver,port,name,device_status\n{first},4841,"Press, 1",\n{second},,,0\n'
    response = await api.post("/gds/inventory/import", content=csv.encode(), headers=CSV)
    assert response.status_code == 200, response.text
    result = response.json()
    assert (result["mode"], result["imported"], result["failed"]) == ("atomic", 2, 0)
    assert [(row["row"], row["address"], row["ok"]) for row in result["rows"]] == [
        (1, f"{first}:4841", True), (2, f"{second}:4840", True)
    ]  # fmt: skip
    stored = (await api.get(f"/gds/inventory/{first}:4841")).json()
    assert (stored["id"], stored["name"]) == (result["rows"][0]["id"], "Press, 1")
    assert (await api.get(f"/gds/inventory/{second}")).json()["device_status"] == 0


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b'server,port\n"plc-1,1\n', "the CSV import is malformed at line"),
        (b'server,port\npl"c-1,1\n"x"y,1\n', "the CSV import is malformed at line 3"),
        (b"server,port\nplc-\xff,1\n", "the CSV import is not UTF-8: byte 16 is 0xff"),
        (b"server,port\nplc-\x00,1\n", "the CSV import contains a NUL character"),
        (b"port,name\n1,x\n", "the CSV header row must name each column once, server among them"),
        (b"server,colour\nplc-1,red\n", "the CSV header row must name each column once"),
        (b"server,server\nplc-1,plc-2\n", "the CSV header row must name each column once"),
        (b"server,port\nplc-1\n", "CSV line 2 has 1 fields, the header 2"),
        (b"server,port\nplc-1,1,extra\n", "CSV line 2 has 3 fields, the header 2"),
        (b"\n\n", "the CSV import is empty"),
        (b"server,port\n", "the import holds no rows"),
        (TOO_MANY.encode(), f"the import holds {MAX_IMPORT_ROWS + 1} rows, at most"),
    ],
    ids=["unterminated quote", "quote inside a field", "not UTF-8", "NUL", "no server column", "unknown column",
         "column twice", "short line", "long line", "empty", "header only", "too many rows"],
)  # fmt: skip
async def test_a_bad_csv_file_is_refused_naming_the_problem_and_stores_nothing(api, body: bytes, error: str) -> None:
    before = await gds_count(api)
    response = await api.post("/gds/inventory/import?mode=per_row", content=body, headers=CSV)
    assert response.status_code == 400, response.text
    assert response.json()["error"].startswith(error)
    assert await gds_count(api) == before


async def test_a_csv_over_the_body_limit_is_refused_with_413(api) -> None:
    before = await gds_count(api)
    rows = "".join(f"plc-{n:07d}.plant.local,4840,Press {n}\n" for n in range(40_000))  # about 1.5 MiB
    response = await api.post("/gds/inventory/import", content=f"server,port,name\n{rows}".encode(), headers=CSV)
    assert response.status_code == 413
    assert await gds_count(api) == before


async def test_an_atomic_csv_import_with_a_refused_row_answers_every_rows_result(api) -> None:
    good, bad = hosts(2)
    before = await gds_count(api)
    response = await api.post("/gds/inventory/import", content=f"server,port\n{good},1\n{bad},70000\n", headers=CSV)
    assert response.status_code == 400
    body = response.json()
    assert body["error"] == "1 of 2 rows refused: nothing imported"
    assert [(row["ok"], row["id"]) for row in body["rows"]] == [(True, None), (False, None)]
    assert "port" in body["rows"][1]["error"]
    assert await gds_count(api) == before


async def test_openapi_documents_the_csv_body(api) -> None:
    document = (await api.get("/openapi.json")).json()
    content = document["paths"]["/gds/inventory/import"]["post"]["requestBody"]["content"]
    assert set(content) == {"application/json", "text/csv"}
    assert content["text/csv"]["schema"]["type"] == "string"


# Integers that are not written as JSON writes them: other scripts' digits, spaces, signs, leading zeros, fractions.
NOT_JSON_INTEGERS = [
    "\u0661\u0662", "\uff11\uff12", "\u096a\u096e\u096a\u0966", "12 ", " 12", "\u00a012", "+12", "012", "1_2", "12.0",
    "1e1", "0x10",
]
NOT_JSON_INTEGER_IDS = [
    "arabic-indic", "fullwidth", "devanagari", "trailing-space", "leading-space", "no-break-space", "plus",
    "leading-zero", "underscore", "fraction", "exponent", "hex",
]


@pytest.mark.parametrize("column", ["port", "renewal_days"])
@pytest.mark.parametrize("cell", NOT_JSON_INTEGERS, ids=NOT_JSON_INTEGER_IDS)
async def test_a_csv_integer_is_refused_unless_written_as_json_writes_it(api, column: str, cell: str) -> None:
    """``certlm import`` took a port "١٢" as 12: a CSV cell is refused as ``POST /gds/inventory`` refuses the same
    text in JSON, with the same error, and nothing is stored."""
    (host,) = hosts(1)
    csv = f'server,{column}\n{host},"{cell}"\n'
    response = await api.post("/gds/inventory/import?mode=per_row", content=csv.encode(), headers=CSV)
    assert response.status_code == 200, response.text
    (row,) = response.json()["rows"]
    direct = await api.post("/gds/inventory", json={"server": host, column: cell})
    assert direct.status_code == 400
    assert row["ok"] is False and row["error"] == direct.json()["error"] == f"{column}: Input should be a valid integer"
    assert (await api.get(f"/gds/inventory/{host}")).status_code == 404


async def test_a_csv_integer_in_ascii_digits_is_stored_as_that_integer(api) -> None:
    first, second = hosts(2)
    csv = f"server,port,renewal_days\n{first},4841,0\n{second},12,30\n"
    response = await api.post("/gds/inventory/import", content=csv.encode(), headers=CSV)
    assert response.status_code == 200, response.text
    assert (await api.get(f"/gds/inventory/{first}:4841")).json()["renewal_days"] == 0
    assert (await api.get(f"/gds/inventory/{second}:12")).json()["renewal_days"] == 30


def test_csv_cells_become_the_json_fields_of_post() -> None:
    rows = parse_import(
        '\ufeffserver,port,name,device_status\nplc-1,4841,"Press, 1",\nplc-2,x,,0\n'.encode(), "text/csv"
    )
    assert rows == [{"server": "plc-1", "port": 4841, "name": "Press, 1"},
                    {"server": "plc-2", "port": "x", "device_status": 0}]  # fmt: skip


TOO_MANY_JSON = json.dumps([{"server": f"plc-{n}"} for n in range(MAX_IMPORT_ROWS + 1)]).encode()


@pytest.mark.parametrize(
    ("body", "content_type", "status", "error"),
    [
        (b'{"server": "plc-1"}', "application/json", 400, "a JSON import is an array of entries"),
        (b"[{", "application/json", 400, "the import is not valid JSON"),
        (b"[]", "application/json", 400, "the import holds no rows"),
        (b'[{"server": "plc-\xff"}]', "application/json", 400, "request body is not UTF-8"),
        (TOO_MANY_JSON, "application/json", 400, f"the import holds {MAX_IMPORT_ROWS + 1} rows, at most"),
        (b"server\nplc-1\n", "text/plain", 415, "unsupported content type 'text/plain': send application/json or"),
        (b"[" + b" " * (1024 * 1024) + b"]", "application/json", 413, ""),
    ],
    ids=["not an array", "bad JSON", "empty array", "not UTF-8", "too many rows", "other media type", "huge body"],
)  # fmt: skip
async def test_a_bad_import_body_is_refused_and_stores_nothing(api, body, content_type, status, error) -> None:
    before = await gds_count(api)
    response = await api.post("/gds/inventory/import", content=body, headers={"Content-Type": content_type})
    assert response.status_code == status, response.text
    assert response.json()["error"].startswith(error)
    assert await gds_count(api) == before


async def test_an_unknown_mode_and_rows_that_are_no_objects_are_refused(api) -> None:
    server = hosts(1)[0]
    unknown = await api.post("/gds/inventory/import?mode=some", json=[{"server": server}])
    assert unknown.status_code == 400 and "mode" in unknown.json()["error"]
    result = (await api.post("/gds/inventory/import?mode=per_row", content=json.dumps([[server], {"server": server}]),
                             headers={"Content-Type": "application/json"})).json()  # fmt: skip
    assert result["rows"][0] == {"row": 1, "address": None, "ok": False, "id": None,
                                 "error": "an entry is a JSON object, not list"}  # fmt: skip
    assert result["rows"][1]["ok"] is True


async def test_only_the_import_route_takes_csv(api) -> None:
    response = await api.post("/gds/inventory", content=f"server\n{hosts(1)[0]}\n", headers=CSV)
    assert response.status_code == 415
    assert response.json()["error"] == "unsupported content type 'text/csv': send application/json"
