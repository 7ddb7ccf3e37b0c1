"""The batch-size server's limits (issue 13): Zeus's own app behind our RequestLimits middleware, driven
in-process through httpx's ASGI transport (no port is opened)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("aiosqlite")
httpx = pytest.importorskip("httpx")

from lightning_energy.optimize import bso_server  # noqa: E402
from lightning_energy.optimize.bso_server import MAX_BATCH_SIZES, MAX_BODY_BYTES, RequestLimits, check_request  # noqa: E402

JOB = {"job_id": "trust-1", "job_id_prefix": "trust", "batch_sizes": [32, 64, 128], "default_batch_size": 64,
       "max_power": 300.0, "number_of_gpus": 1, "gpu_model": "V100", "max_epochs": 5, "target_metric": 0.5}


@pytest.fixture(scope="module")
def zeus_app(tmp_path_factory):
    """Zeus's app on a fresh SQLite file (Zeus reads the URL when its server module is first imported)."""
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('bso') / 'bso.sqlite3'}"
    previous = os.environ.get("ZEUS_BSO_DATABASE_URL")
    os.environ["ZEUS_BSO_DATABASE_URL"] = url
    try:
        app, base, sessionmanager, _ = bso_server.load_server()
    except Exception as err:  # noqa: BLE001 - the environment cannot run Zeus's server
        pytest.skip(f"Zeus's BSO server cannot load here: {err}")
    finally:
        if previous is None:
            os.environ.pop("ZEUS_BSO_DATABASE_URL", None)
        else:
            os.environ["ZEUS_BSO_DATABASE_URL"] = previous
    asyncio.run(bso_server.create_tables(base, sessionmanager))
    yield app
    asyncio.run(sessionmanager._engine.dispose())  # close the pool's SQLite connections before exit


def requests(app, calls):
    """Run ``calls(client)`` (an async function) against ``app`` behind RequestLimits; return its result."""

    async def go():
        transport = httpx.ASGITransport(app=RequestLimits(app))
        async with httpx.AsyncClient(transport=transport, base_url="http://bso.test") as client:
            return await calls(client)

    return asyncio.run(go())


def test_valid_requests_pass_through_to_zeus(zeus_app):
    async def calls(client):
        registered = await client.post("/jobs", json=JOB)
        trial = await client.get("/jobs/batch_size", params={"job_id": JOB["job_id"]})
        report = await client.post("/report", json={**trial.json(), "time": 1.0, "energy": 50.0, "metric": 0.1,
                                                    "current_epoch": 1})
        return registered, trial, report

    registered, trial, report = requests(zeus_app, calls)
    assert registered.status_code == 201, registered.text
    assert trial.status_code == 200 and trial.json()["batch_size"] == 64  # Zeus's first trial: the default size
    assert report.status_code == 200 and report.json()["stop_train"] is False


@pytest.mark.parametrize("size", [MAX_BODY_BYTES + 1, 300 * 2**20])
def test_oversized_body_is_413_without_reading_it(zeus_app, size):
    """A declared length over the limit is refused before a byte of the body is read."""
    async def calls(client):
        return await client.post("/jobs", content=_NeverRead(size), headers={"content-length": str(size)})

    response = requests(zeus_app, calls)
    assert response.status_code == 413 and str(MAX_BODY_BYTES) in response.json()["message"]


class _NeverRead:
    """A request body that fails the test if anyone iterates it past the first 64 kB."""

    def __init__(self, size: int) -> None:
        self.size = size

    async def __aiter__(self):
        sent = 0
        while sent < self.size:
            chunk = b" " * min(2**16, self.size - sent)
            sent += len(chunk)
            assert sent <= 2 * MAX_BODY_BYTES, "the body was read past the limit"
            yield chunk


def test_streamed_body_without_length_stops_at_the_limit():
    """No Content-Length (chunked): reading stops at the first chunk past the limit; the app never runs."""
    chunks = [b" " * 4096] * 1000
    consumed = []
    called = []

    async def receive():
        consumed.append(1)
        return {"type": "http.request", "body": chunks[len(consumed) - 1], "more_body": len(consumed) < len(chunks)}

    async def app(scope, receive, send):
        called.append(scope)

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/jobs", "headers": [], "query_string": b""}
    asyncio.run(RequestLimits(app)(scope, receive, send))
    assert sent[0]["status"] == 413 and not called
    assert len(consumed) == MAX_BODY_BYTES // 4096 + 1


def test_too_many_batch_sizes_are_refused_before_zeus_sees_them(zeus_app):
    job = {**JOB, "job_id": "trust-2", "batch_sizes": list(range(1, 5001)), "default_batch_size": 1}
    assert len(json.dumps(job)) < MAX_BODY_BYTES  # refused for the count, not the size

    async def calls(client):
        refused = await client.post("/jobs", json=job)
        lookup = await client.get("/jobs/batch_size", params={"job_id": "trust-2"})
        huge = await client.post("/jobs", json={**job, "batch_sizes": list(range(1, 100_001))})
        return refused, lookup, huge

    refused, lookup, huge = requests(zeus_app, calls)
    assert refused.status_code == 422 and f"1 to {MAX_BATCH_SIZES} batch sizes" in refused.json()["message"]
    assert lookup.status_code == 400 and "Unknown job(trust-2)" in lookup.text  # Zeus never registered it
    assert huge.status_code == 413


@pytest.mark.parametrize("field, value, status", [
    ("energy", -5.0, 422), ("time", -1.0, 422), ("energy", "NaN", 422), ("metric", "Infinity", 422),
    ("current_epoch", 10**9, 422), ("batch_size", 0, 422), ("job_id", "x" * 10_000, 422),
])
def test_report_values_outside_their_bounds_are_4xx(zeus_app, field, value, status):
    report = {"job_id": JOB["job_id"], "batch_size": 64, "trial_number": 1, "time": 1.0, "energy": 50.0,
              "metric": 0.1, "current_epoch": 1}
    body = json.dumps(report)
    if value in ("NaN", "Infinity"):
        body = body.replace(f'"{field}": {report[field]}', f'"{field}": {value}')
    else:
        body = json.dumps({**report, field: value})

    async def calls(client):
        return await client.post("/report", content=body, headers={"content-type": "application/json"})

    response = requests(zeus_app, calls)
    assert response.status_code == status, response.text
    assert field in response.json()["message"]


@pytest.mark.parametrize("body, status", [(b"{not json", 400), (b"[1, 2]", 400), (b"[" * 100_000, 400),
                                          (b'{"eta_knob": 2}', 422), (b'{"batch_sizes": [64, 64]}', 422),
                                          (b'{"batch_sizes": [true]}', 422), (b"", 200), (b'{"other": 1}', 200)])
def test_bodies_are_checked_before_zeus(body, status):
    assert check_request(b"", body)[0] == status


def test_default_host_is_this_machine_only():
    parser = argparse.ArgumentParser()
    bso_server.add_arguments(parser)
    assert parser.parse_args([]).host == "127.0.0.1"
