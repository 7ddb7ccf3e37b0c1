"""Real Prometheus and Pushgateway servers for the tests: Debian's ``prometheus`` and ``prometheus-pushgateway``
binaries, started here on 127.0.0.1 on free ports with a temporary configuration and storage, and stopped after.

Readiness is awaited by polling each server's ``/-/ready`` endpoint (bounded by a generous timeout: a slow
machine only waits longer); a value is awaited by polling a PromQL query through the HTTP API until it holds.
Tests skip, naming the package, only when a binary is absent (``.ci/run`` installs both).
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

PROMETHEUS = shutil.which("prometheus")
PUSHGATEWAY = shutil.which("prometheus-pushgateway") or shutil.which("pushgateway")
READY_TIMEOUT_S = 120.0  # generous: a bound on a wait, never a timing assertion
VALUE_TIMEOUT_S = 120.0
POLL_S = 0.05
SCRAPE_INTERVAL = "200ms"


def need(binary: str | None, package: str) -> str:
    if binary is None:
        pytest.skip(f"Debian's `{package}` package is not installed (apt-get install {package})")
    return binary


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    process: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> "Server":
        """Poll ``/-/ready`` until it answers 200 (or fail with the server's log if it exits or never does)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.fail(f"exited with code {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as reply:
                    if reply.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(POLL_S)
        self.fail(f"not ready within {timeout_s:g} s")

    def fail(self, why: str) -> None:
        self.stop()
        pytest.fail(f"{self.name} {why}; its log:\n{self.log.read_text()[-3000:]}")


def _start(name: str, argv: list[str], port: int, folder: Path) -> Server:
    log = folder / f"{name}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=folder)
    return Server(name, process, port, log)


def start_pushgateway(folder: Path) -> Server:
    """A Pushgateway on a free port of 127.0.0.1, ready (no persistence: its groups live in memory)."""
    binary = need(PUSHGATEWAY, "prometheus-pushgateway")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    return _start("pushgateway", [binary, f"--web.listen-address=127.0.0.1:{port}"], port, folder).wait_ready()


def start_prometheus(folder: Path, targets: dict[str, str]) -> Server:
    """A Prometheus on a free port of 127.0.0.1 scraping each ``targets`` entry (a ``via`` label -> its
    ``127.0.0.1:port``) every :data:`SCRAPE_INTERVAL` with ``honor_labels: true`` (as the README says to scrape
    the exporter and the Pushgateway), each target's series labelled ``via="<name>"``; ready."""
    binary = need(PROMETHEUS, "prometheus")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    jobs = "\n".join(
        f"  - job_name: {via}\n    honor_labels: true\n    static_configs:\n"
        f"      - targets: ['{target}']\n        labels: {{via: {via}}}"
        for via, target in targets.items())
    config = folder / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: {SCRAPE_INTERVAL}\n  scrape_timeout: {SCRAPE_INTERVAL}\n"
                      f"scrape_configs:\n{jobs}\n")
    argv = [binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=info"]
    return _start("prometheus", argv, port, folder).wait_ready()


def query(prometheus: Server, promql: str) -> list[dict]:
    """The result vector of an instant PromQL query through ``/api/v1/query``."""
    url = f"{prometheus.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as reply:
        body = json.loads(reply.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for_value(prometheus: Server, promql: str, expected: float, rel: float = 1e-9,
                   timeout_s: float = VALUE_TIMEOUT_S) -> float:
    """Poll ``promql`` (one series) until its value is ``expected`` (relative ``rel``); the value. Fails with
    the last answer when the bound runs out."""
    deadline = time.monotonic() + timeout_s
    answer: list[dict] = []
    while time.monotonic() < deadline:
        answer = query(prometheus, promql)
        if len(answer) == 1:
            value = float(answer[0]["value"][1])
            if math.isclose(value, expected, rel_tol=rel):
                return value
        time.sleep(POLL_S)
    pytest.fail(f"{promql} never returned {expected!r} within {timeout_s:g} s; last answer: {answer}")


def pushgateway_groups(pushgateway: Server) -> list[dict]:
    """The Pushgateway's groups (``/api/v1/metrics``): each with its ``labels`` (the grouping key)."""
    with urllib.request.urlopen(f"{pushgateway.url}/api/v1/metrics", timeout=10) as reply:
        return json.loads(reply.read())["data"]
