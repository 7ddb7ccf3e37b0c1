"""A Redfish BMC on 127.0.0.1 for tests: DMTF-schema JSON, a power trace the test drives, and its faults.

It serves what a current BMC serves for a node's power (DSP0266, schemas Chassis v1_21, EnvironmentMetrics
v1_3, Power v1_7, SessionService v1_1): the service root, ``/redfish/v1/Chassis`` (the node's chassis ``1`` and
a GPU baseboard ``GPU_Baseboard`` contained in it, with a reading of its own that is NOT the node's),
``Chassis/1/EnvironmentMetrics`` (``PowerWatts``, and ``EnergyJoules`` / ``EnergykWh`` counters when asked)
and the older ``Chassis/1/Power`` (``PowerControl[0].PowerConsumedWatts``). Authentication as a BMC does it:
``POST /redfish/v1/SessionService/Sessions`` with ``UserName``/``Password`` gives ``201`` with an
``X-Auth-Token`` and a ``Location``; every other resource but the service root answers ``401`` without a valid
token (or basic auth); ``DELETE`` of the session's URI logs out. HTTP/1.1 with keep-alive.

What the test controls (no wall clock): ``power_W`` (a number, or a function of the count of power reads so
far), ``energy_J`` (the counter's value; ``energy_step_J`` adds to it at every read), ``energy_unit``
(``"J"`` or ``"kWh"`` and ``kwh_decimals``), ``legacy_only`` (no EnvironmentMetrics), and faults that apply to
the next N power reads: ``fail_next(n, status)`` (503, 500...), ``malformed_next(n)``, ``null_next(n)``,
``hold_next(n)`` (the reply waits on an Event the test sets: a read that times out), ``expire_sessions()``
(the next request with an old token gets 401, as after a BMC's session timeout).
"""

from __future__ import annotations

import base64
import json
import secrets
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SESSIONS = "/redfish/v1/SessionService/Sessions"
ODATA = {"@odata.context": "/redfish/v1/$metadata"}


def make_certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (``openssl`` CLI): (cert.pem, key.pem)."""
    cert, key = folder / "bmc-cert.pem", folder / "bmc-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


class FakeBmc:
    def __init__(self, user: str = "admin", password: str = "s3cret-BMC-pw", certificate: tuple[Path, Path] | None = None,
                 sessions: bool = True) -> None:
        self.user, self.password, self.sessions = user, password, sessions
        self.power_W: float | object = 500.0
        self.energy_J: float | None = None
        self.energy_step_J = 0.0
        self.energy_unit = "J"
        self.kwh_decimals = 6
        self.lifetime = False
        self.reset_time = "2024-01-01T00:00:00Z"
        self.legacy_only = False
        self.fail_from_read: int | None = None  # every power read from this count on answers 503 (a BMC gone bad)
        self.power_reads = 0
        self.logins = 0
        self.logouts = 0
        self.connections = 0
        self.requests: list[tuple[str, str]] = []
        self.tokens: set[str] = set()
        self.issued_tokens: list[str] = []
        self._faults: list[tuple[str, object]] = []
        self.release = threading.Event()
        self._lock = threading.Lock()
        bmc = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with bmc._lock:
                    bmc.connections += 1

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                bmc._handle(self, "GET")

            def do_POST(self) -> None:
                bmc._handle(self, "POST")

            def do_DELETE(self) -> None:
                bmc._handle(self, "DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.scheme = "http"
        if certificate is not None:
            import ssl

            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(certificate[0]), str(certificate[1]))
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            self.scheme = "https"
        self.port = self.server.server_address[1]
        # serve_forever's default 0.5 s poll would make each close() wait up to half a second
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), name="fake-bmc", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------ faults
    def fail_next(self, n: int, status: int = 503) -> None:
        self._faults += [("status", status)] * n

    def malformed_next(self, n: int) -> None:
        self._faults += [("malformed", None)] * n

    def null_next(self, n: int) -> None:
        self._faults += [("null", None)] * n

    def hold_next(self, n: int) -> None:
        self._faults += [("hold", None)] * n

    def expire_sessions(self) -> None:
        with self._lock:
            self.tokens.clear()

    # ------------------------------------------------------------------ resources
    def _power_now(self) -> float:
        value = self.power_W(self.power_reads) if callable(self.power_W) else self.power_W
        return float(value)

    def _counter_excerpt(self) -> dict:
        value = self.energy_J
        if self.energy_unit == "kWh":  # printed with exactly kwh_decimals decimals (see _reply)
            number = f"__KWH__{value / 3.6e6:.{self.kwh_decimals}f}"
        else:
            number = value
        key = "LifetimeReading" if self.lifetime else "Reading"
        excerpt = {"DataSourceUri": "/redfish/v1/Chassis/1/Sensors/Energy", key: number}
        if not self.lifetime:
            excerpt["SensorResetTime"] = self.reset_time
        return excerpt

    def _resource(self, path: str, fault: tuple[str, object] | None) -> tuple[int, object]:
        if path in ("/redfish/v1", "/redfish/v1/"):
            return 200, {**ODATA, "@odata.id": "/redfish/v1", "@odata.type": "#ServiceRoot.v1_16_0.ServiceRoot",
                         "Id": "RootService", "Name": "Root Service", "RedfishVersion": "1.17.0",
                         "Chassis": {"@odata.id": "/redfish/v1/Chassis"},
                         "SessionService": {"@odata.id": "/redfish/v1/SessionService"}}
        if path == "/redfish/v1/Chassis":
            return 200, {**ODATA, "@odata.id": path, "@odata.type": "#ChassisCollection.ChassisCollection",
                         "Name": "Chassis Collection", "Members@odata.count": 2,
                         # the baseboard first: the node's chassis must be found by its links, not by order
                         "Members": [{"@odata.id": "/redfish/v1/Chassis/GPU_Baseboard"},
                                     {"@odata.id": "/redfish/v1/Chassis/1"}]}
        if path == "/redfish/v1/Chassis/GPU_Baseboard":
            return 200, {**ODATA, "@odata.id": path, "@odata.type": "#Chassis.v1_21_0.Chassis", "Id": "GPU_Baseboard",
                         "Name": "GPU baseboard", "ChassisType": "Module",
                         "Links": {"ContainedBy": {"@odata.id": "/redfish/v1/Chassis/1"}},
                         "EnvironmentMetrics": {"@odata.id": f"{path}/EnvironmentMetrics"}}
        if path == "/redfish/v1/Chassis/GPU_Baseboard/EnvironmentMetrics":
            return 200, {**ODATA, "@odata.id": path, "@odata.type": "#EnvironmentMetrics.v1_3_0.EnvironmentMetrics",
                         "Id": "EnvironmentMetrics", "Name": "GPU baseboard metrics",
                         "PowerWatts": {"DataSourceUri": "/redfish/v1/Chassis/GPU_Baseboard/Sensors/Power",
                                        "Reading": 123.0}}
        if path == "/redfish/v1/Chassis/1":
            links = {"ComputerSystems": [{"@odata.id": "/redfish/v1/Systems/1"}],
                     "Contains": [{"@odata.id": "/redfish/v1/Chassis/GPU_Baseboard"}]}
            chassis = {**ODATA, "@odata.id": path, "@odata.type": "#Chassis.v1_21_0.Chassis", "Id": "1",
                       "Name": "Computer System Chassis", "ChassisType": "RackMount", "Links": links,
                       "Power": {"@odata.id": f"{path}/Power"}}
            if not self.legacy_only:
                chassis["EnvironmentMetrics"] = {"@odata.id": f"{path}/EnvironmentMetrics"}
                chassis["PowerSubsystem"] = {"@odata.id": f"{path}/PowerSubsystem"}
            return 200, chassis
        if path == "/redfish/v1/Chassis/1/EnvironmentMetrics" and not self.legacy_only:
            self.power_reads += 1
            if fault is not None and fault[0] == "malformed":
                return 200, b'{"PowerWatts": {"Reading": 5'
            power = None if fault is not None and fault[0] == "null" else self._power_now()
            body = {**ODATA, "@odata.id": path, "@odata.type": "#EnvironmentMetrics.v1_3_0.EnvironmentMetrics",
                    "Id": "EnvironmentMetrics", "Name": "Chassis Environment Metrics",
                    "PowerWatts": {"DataSourceUri": "/redfish/v1/Chassis/1/Sensors/TotalPower", "Reading": power}}
            if self.energy_J is not None:
                self.energy_J += self.energy_step_J
                body["EnergyJoules" if self.energy_unit == "J" else "EnergykWh"] = self._counter_excerpt()
            return 200, body
        if path == "/redfish/v1/Chassis/1/Power":
            self.power_reads += 1
            if fault is not None and fault[0] == "malformed":
                return 200, b"<html>Service Unavailable</html>"
            power = None if fault is not None and fault[0] == "null" else self._power_now()
            return 200, {**ODATA, "@odata.id": path, "@odata.type": "#Power.v1_7_1.Power", "Id": "Power",
                         "Name": "Power", "PowerControl": [{
                             "@odata.id": f"{path}#/PowerControl/0", "MemberId": "0", "Name": "System Power Control",
                             "PowerConsumedWatts": power,
                             "PowerMetrics": {"IntervalInMin": 1, "AverageConsumedWatts": power}}]}
        return 404, {"error": {"code": "Base.1.8.ResourceMissingAtURI", "message": f"{path} not found"}}

    # ------------------------------------------------------------------ requests
    def _authorised(self, handler) -> bool:
        token = handler.headers.get("X-Auth-Token")
        if token is not None:
            return token in self.tokens
        auth = handler.headers.get("Authorization", "")
        if auth.startswith("Basic "):
            return base64.b64decode(auth[6:]).decode() == f"{self.user}:{self.password}"
        return False

    def _reply(self, handler, status: int, body, headers: dict | None = None) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        while b'"__KWH__' in data:  # a number written with its trailing zeros, as a BMC prints it
            start = data.index(b'"__KWH__')
            end = data.index(b'"', start + 1)
            data = data[:start] + data[start + 8:end] + data[end + 1:]
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.send_header("OData-Version", "4.0")
        for key, value in (headers or {}).items():
            handler.send_header(key, value)
        handler.end_headers()
        handler.wfile.write(data)

    def _handle(self, handler, method: str) -> None:
        path = handler.path.split("?")[0]
        length = int(handler.headers.get("Content-Length") or 0)
        payload = handler.rfile.read(length) if length else b""
        self.requests.append((method, path))
        if method == "POST" and path == SESSIONS:
            if not self.sessions:
                return self._reply(handler, 405, {"error": {"message": "no session service"}})
            try:
                given = json.loads(payload)
            except ValueError:
                return self._reply(handler, 400, {"error": {"message": "malformed"}})
            if given.get("UserName") != self.user or given.get("Password") != self.password:
                return self._reply(handler, 401, {"error": {"message": "Invalid username or password"}})
            token = secrets.token_hex(16)
            with self._lock:
                self.tokens.add(token)
                self.issued_tokens.append(token)
                self.logins += 1
            location = f"{SESSIONS}/{self.logins}"
            return self._reply(handler, 201, {"@odata.id": location, "Id": str(self.logins), "UserName": self.user},
                               {"X-Auth-Token": token, "Location": location})
        if path not in ("/redfish/v1", "/redfish/v1/") and not self._authorised(handler):
            return self._reply(handler, 401, {"error": {"message": "Unauthorized"}})
        if method == "DELETE" and path.startswith(SESSIONS + "/"):
            with self._lock:
                self.tokens.discard(handler.headers.get("X-Auth-Token"))
                self.logouts += 1
            return self._reply(handler, 204, b"")
        is_reading = path in ("/redfish/v1/Chassis/1/EnvironmentMetrics", "/redfish/v1/Chassis/1/Power")
        fault = self._faults.pop(0) if is_reading and self._faults else None
        if is_reading and self.fail_from_read is not None and self.power_reads >= self.fail_from_read:
            fault = ("status", 503)
        if fault is not None and fault[0] == "status":
            return self._reply(handler, int(fault[1]), {"error": {"message": "Service temporarily unavailable"}},
                               {"Retry-After": "1"})
        if fault is not None and fault[0] == "hold":
            self.release.wait()
        status, body = self._resource(path, fault)
        self._reply(handler, status, body)
