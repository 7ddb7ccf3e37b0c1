"""The whole node's power from its BMC over Redfish (DMTF DSP0266), scope ``"node"``.

Where the node's power is read, in the order tried on each chassis (``/redfish/v1/Chassis/{id}``):

1. ``EnvironmentMetrics`` (Chassis v1_15+): ``EnergyJoules`` or ``EnergykWh`` (a counter; its
   ``LifetimeReading``, never reset by ``ResetMetrics``, else its ``Reading``), preferred where its step is
   fine enough (:data:`AUTO_COUNTER_MAX_RESOLUTION_J`: a BMC that prints kWh with three decimals moves by
   3.6 kJ, coarser than 1 Hz power readings over any window shorter than an hour), else ``PowerWatts.Reading``;
2. the older ``Power`` resource: ``PowerControl[0].PowerConsumedWatts`` (the chassis' total).

The chassis read is the node's: the one given, else the first of ``/redfish/v1/Chassis`` that is contained
in no other chassis (no ``Links.ContainedBy``: a GPU baseboard or a PSU bay is a sub-chassis) and holds a
reading, else the first that holds one. :attr:`Sensor.source` names the chassis and the property read.

Transport: the standard library only (``http.client`` + ``ssl``). HTTPS with certificate checks on (the
system's CA store, or ``ca_bundle``); ``insecure=True`` turns them off and the sensor's ``source`` says so in
every report. One connection kept alive; a Redfish session (``POST /redfish/v1/SessionService/Sessions``,
then the ``X-Auth-Token`` header; re-created once on a 401, deleted at ``close()``), or HTTP basic auth where
the service has no session service. Credentials are held in a :class:`Credentials` object whose ``repr``
hides the password; no message, ``source``, ``describe()`` or ``repr`` of this module holds them, nor the
URL's user part (refused: credentials go in :class:`Credentials`).

Timing: a BMC refreshes its readings every 1-10 s and a read takes 0.1-2 s. The sensor reads at most every
``min_read_interval_s`` (default 1 s: faster reads return the same value and load the BMC); a read slower
than a quarter of the sampling interval moves it to a reader thread of its own (the sampler's slow-sensor
rule), so the other sensors keep their rate. Each request times out after ``timeout_s`` (default 1.8 s,
below the sampler's ``READ_TIMEOUT_S`` of 2 s, so that a slow BMC costs a counted read error rather than a
sensor declared hung). A counter's ``counter_update_period_s`` is ``update_period_s`` (default 2 s): the
series places each update inside the read interval that saw it, and its bound spans that interval.

Errors raise :class:`RedfishError` (HTTP status, malformed or oversized JSON, a missing or null reading,
a timeout): the sampler counts them against the sensor's error budget and fails it past the budget.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import ssl
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from lightning_energy.measure.sensors.base import Sensor

DEFAULT_TIMEOUT_S = 1.8  # below the sampler's READ_TIMEOUT_S (2 s): a slow BMC is a read error, not a hang
DEFAULT_MIN_READ_INTERVAL_S = 1.0  # BMCs refresh every 1-10 s: reading faster only loads them
DEFAULT_UPDATE_PERIOD_S = 2.0  # the counter's refresh period assumed by the series (set it to the BMC's)
MAX_BODY_BYTES = 1 << 20  # a Redfish resource is a few kB; anything past 1 MiB is refused unread
J_PER_KWH = 3.6e6
# "auto" reads a counter only when its step is at most this (J): kWh printed with >= 5 decimals (36 J), or
# EnergyJoules. A 1 kW node moves a 0.001 kWh counter once every 3.6 s: power readings are finer than that.
AUTO_COUNTER_MAX_RESOLUTION_J = 100.0
READINGS = ("auto", "energy", "power")
SERVICE_ROOT = "/redfish/v1"


class RedfishError(RuntimeError):
    """A Redfish request that did not give a usable reading (never holds credentials)."""


@dataclass(frozen=True)
class Credentials:
    """A BMC user and password; ``repr`` and ``str`` never show the password."""

    user: str
    password: str

    def __repr__(self) -> str:
        return f"Credentials(user={self.user!r}, password=<hidden>)"

    __str__ = __repr__


class _Number(float):
    """A JSON number that remembers how many decimals it was written with (a counter's step)."""

    decimals: int = 0


def _parse_float(text: str) -> _Number:
    number = _Number(text)
    mantissa = text.lower().split("e")[0]
    exponent = int(text.lower().split("e")[1]) if "e" in text.lower() else 0
    number.decimals = max(len(mantissa.partition(".")[2]) - exponent, 0)
    return number


class RedfishClient:
    """GETs on one Redfish service over one kept-alive connection, authenticated by a session or basic auth.

    ``url``: the service's scheme, host and port (``https://bmc.example``; a path is ignored); ``ca_bundle``:
    a PEM file of CAs to trust instead of the system's; ``insecure``: no certificate check (labelled);
    plain ``http://`` is accepted only without credentials or with ``insecure``. Thread-safe (one request at
    a time)."""

    def __init__(self, url: str, credentials: Credentials | None = None, ca_bundle: str | None = None,
                 insecure: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("https", "http") or not parts.hostname:
            raise ValueError("the Redfish URL must look like https://HOST[:PORT]")
        if parts.username is not None or parts.password is not None:
            raise ValueError("the Redfish URL must not hold credentials; give them as Credentials "
                             "(LIGHTNING_ENERGY_REDFISH_USER and ..._PASSWORD_FILE)")
        if parts.scheme == "http" and credentials is not None and not insecure:
            raise ValueError("refusing to send BMC credentials over plain http://; use https:// "
                             "(or insecure=True, labelled in the report)")
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= 60):
            raise ValueError(f"timeout_s must be in (0, 60] s, got {timeout_s!r}")
        self.scheme, self.host = parts.scheme, parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.credentials = credentials
        self.ca_bundle, self.insecure, self.timeout_s = ca_bundle, bool(insecure), float(timeout_s)
        self._context = self._tls_context() if self.scheme == "https" else None
        self._connection: http.client.HTTPConnection | None = None
        self._token: str | None = None
        self._session_uri: str | None = None
        self._basic = False
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        """``scheme://host:port`` (no credentials)."""
        return f"{self.scheme}://{self.host}:{self.port}"

    @property
    def tls(self) -> str:
        """How the BMC's certificate is checked, in words (for the report)."""
        if self.scheme == "http":
            return "plain http, NOT ENCRYPTED"
        if self.insecure:
            return "https, certificate NOT VERIFIED (insecure)"
        return f"https, certificate verified against {self.ca_bundle}" if self.ca_bundle else "https, certificate verified"

    def _tls_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_bundle)
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

    # ------------------------------------------------------------------ requests
    def get(self, path: str) -> dict:
        """The JSON object at ``path`` (a Redfish URI). Raises :class:`RedfishError`."""
        with self._lock:
            if self.credentials is not None and self._token is None and not self._basic:
                self._login()
            status, headers, body = self._request("GET", path)
            if status == 401 and self._token is not None:  # the session expired: one new login, one retry
                self._token = None
                self._login()
                status, headers, body = self._request("GET", path)
            return self._json(status, path, body)

    def close(self) -> None:
        """Delete the Redfish session (best effort) and close the connection."""
        with self._lock:
            if self._token is not None and self._session_uri:
                try:
                    self._request("DELETE", self._session_uri)
                except RedfishError:
                    pass
            self._token = self._session_uri = None
            if self._connection is not None:
                self._connection.close()
                self._connection = None

    def _login(self) -> None:
        creds = self.credentials
        body = json.dumps({"UserName": creds.user, "Password": creds.password}).encode()
        status, headers, _ = self._request("POST", f"{SERVICE_ROOT}/SessionService/Sessions", body, auth=False)
        if status in (200, 201) and headers.get("x-auth-token"):
            self._token = headers["x-auth-token"]
            location = headers.get("location") or ""
            self._session_uri = urlsplit(location).path or None
            return
        if status in (404, 405, 501):  # no session service: HTTP basic auth on every request
            self._basic = True
            return
        raise RedfishError(f"Redfish login at {self.address} failed: HTTP {status}"
                           + (" (wrong user or password?)" if status in (400, 401, 403) else ""))

    def _auth_headers(self) -> dict[str, str]:
        if self._token is not None:
            return {"X-Auth-Token": self._token}
        if self._basic and self.credentials is not None:
            pair = f"{self.credentials.user}:{self.credentials.password}".encode()
            return {"Authorization": "Basic " + base64.b64encode(pair).decode()}
        return {}

    def _request(self, method: str, path: str, body: bytes | None = None,
                 auth: bool = True) -> tuple[int, dict[str, str], bytes]:
        headers = {"Accept": "application/json", "OData-Version": "4.0", "Connection": "keep-alive"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if auth:
            headers.update(self._auth_headers())
        for attempt in (0, 1):  # a kept-alive connection the BMC closed meanwhile: one fresh one
            connection = self._connect()
            try:
                connection.request(method, path, body=body, headers=headers)
                response = connection.getresponse()
                data = response.read(MAX_BODY_BYTES + 1)
                if len(data) > MAX_BODY_BYTES:
                    raise RedfishError(f"{method} {path}: reply larger than {MAX_BODY_BYTES} bytes")
                if response.will_close:
                    self._drop_connection()
                return response.status, {k.lower(): v for k, v in response.getheaders()}, data
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as err:
                self._drop_connection()
                if attempt:
                    raise RedfishError(f"{method} {path} at {self.address}: {type(err).__name__}") from None
            except TimeoutError:
                self._drop_connection()
                raise RedfishError(f"{method} {path} at {self.address}: no reply within {self.timeout_s:g} s") from None
            except (OSError, http.client.HTTPException) as err:
                self._drop_connection()
                raise RedfishError(f"{method} {path} at {self.address}: {type(err).__name__}: {err}") from None
        raise AssertionError("unreachable")

    def _connect(self) -> http.client.HTTPConnection:
        if self._connection is None:
            if self.scheme == "https":
                self._connection = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout_s,
                                                               context=self._context)
            else:
                self._connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        return self._connection

    def _drop_connection(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    @staticmethod
    def _json(status: int, path: str, body: bytes) -> dict:
        if status != 200:
            raise RedfishError(f"GET {path}: HTTP {status}")
        try:
            value = json.loads(body, parse_float=_parse_float)
        except (ValueError, UnicodeDecodeError) as err:
            raise RedfishError(f"GET {path}: malformed JSON ({type(err).__name__})") from None
        if not isinstance(value, dict):
            raise RedfishError(f"GET {path}: expected a JSON object, got {type(value).__name__}")
        return value


# ---------------------------------------------------------------------- where the node's power is
@dataclass(frozen=True)
class RedfishReading:
    """Which property of which resource is read: ``kind`` ``"energy"`` (a counter, ``unit_J`` J per unit)
    or ``"power"`` (W); ``label``: the words the report shows."""

    chassis: str
    path: str
    kind: str
    field: str  # "EnergyJoules", "EnergykWh", "PowerWatts", "PowerConsumedWatts"
    unit_J: float = 1.0
    resolution_J: float | None = None

    @property
    def label(self) -> str:
        what = {"EnergyJoules": "EnergyJoules counter", "EnergykWh": "EnergykWh counter",
                "PowerWatts": "PowerWatts.Reading (W)",
                "PowerConsumedWatts": "PowerControl[0].PowerConsumedWatts (W)"}[self.field]
        return f"{self.path} {what}"


def _link(resource: dict, name: str) -> str | None:
    value = resource.get(name)
    if isinstance(value, dict) and isinstance(value.get("@odata.id"), str):
        return value["@odata.id"]
    return None


def _counter(metrics: dict, field: str) -> tuple[float, float | None] | None:
    """(value in the field's unit, step in that unit or None) of an EnergyJoules/EnergykWh excerpt."""
    excerpt = metrics.get(field)
    if not isinstance(excerpt, dict):
        return None
    for key in ("LifetimeReading", "Reading"):
        value = excerpt.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
            decimals = getattr(value, "decimals", 0)
            return float(value), 10.0 ** -decimals
    return None


def _get(client: RedfishClient, path: str) -> dict:
    """GET with one retry: a BMC answers 503 now and then, and a probe that reads the wrong chassis because of
    it would be wrong for the whole run."""
    try:
        return client.get(path)
    except RedfishError:
        return client.get(path)


def readings_of_chassis(client: RedfishClient, chassis_path: str) -> list[RedfishReading]:
    """Every reading of the node's power that ``chassis_path`` offers, best first (counters, then power).
    Raises :class:`RedfishError` when a resource it links cannot be read (twice)."""
    chassis = _get(client, chassis_path)
    found: list[RedfishReading] = []
    metrics_path = _link(chassis, "EnvironmentMetrics")
    if metrics_path:
        metrics = _get(client, metrics_path)
        for field, unit in (("EnergyJoules", 1.0), ("EnergykWh", J_PER_KWH)):
            counter = _counter(metrics, field)
            if counter is not None:
                found.append(RedfishReading(chassis_path, metrics_path, "energy", field, unit, counter[1] * unit))
        power = metrics.get("PowerWatts")
        if isinstance(power, dict) and isinstance(power.get("Reading"), (int, float)):
            found.append(RedfishReading(chassis_path, metrics_path, "power", "PowerWatts"))
    power_path = _link(chassis, "Power")
    if power_path and not found:
        power = _get(client, power_path)
        controls = power.get("PowerControl")
        if isinstance(controls, list) and controls and isinstance(controls[0], dict) and isinstance(
                controls[0].get("PowerConsumedWatts"), (int, float)):
            found.append(RedfishReading(chassis_path, power_path, "power", "PowerConsumedWatts"))
    return found


def find_reading(client: RedfishClient, chassis: str | None = None, reading: str = "auto") -> RedfishReading:
    """The reading to use: on ``chassis`` (an id under ``/redfish/v1/Chassis``, or a full path), else on the
    node's chassis (see the module docstring: a sub-chassis only where no chassis is top-level); ``reading`` ``"energy"``/``"power"`` forces the kind,
    ``"auto"`` takes a counter whose step is at most :data:`AUTO_COUNTER_MAX_RESOLUTION_J`. Raises
    :class:`RedfishError` when none is found."""
    if reading not in READINGS:
        raise ValueError(f"reading must be one of {READINGS}, got {reading!r}")
    if chassis:
        paths = [chassis if chassis.startswith("/") else f"{SERVICE_ROOT}/Chassis/{chassis}"]
    else:
        collection = client.get(f"{SERVICE_ROOT}/Chassis")
        members = collection.get("Members")
        paths = [m["@odata.id"] for m in members if isinstance(m, dict) and isinstance(m.get("@odata.id"), str)] \
            if isinstance(members, list) else []
        tops = []
        for path in paths[:32]:  # bounded: a blade enclosure lists a few dozen
            links = _get(client, path).get("Links")
            if not (isinstance(links, dict) and links.get("ContainedBy")):
                tops.append(path)
        paths = tops or paths  # a GPU baseboard's or a PSU bay's power is not the node's
    problem: RedfishError | None = None
    for path in paths[:32]:
        try:
            found = readings_of_chassis(client, path)
        except RedfishError as err:
            problem = err
            continue
        if reading == "power":
            found = [r for r in found if r.kind == "power"]
        elif reading == "energy":
            found = [r for r in found if r.kind == "energy"]
        else:
            found = [r for r in found if r.kind == "power"
                     or (r.resolution_J or math.inf) <= AUTO_COUNTER_MAX_RESOLUTION_J] or found
        if found:
            return found[0]
    if problem is not None:
        raise problem
    kind = {"auto": "power or energy", "energy": "energy counter", "power": "power"}[reading]
    raise RedfishError(f"no {kind} reading found on {client.address} "
                       f"({'chassis ' + chassis if chassis else 'every chassis of ' + SERVICE_ROOT + '/Chassis'})")


# ---------------------------------------------------------------------- the sensors
class _RedfishSensor(Sensor):
    """What both Redfish sensors share: the client, the reading's place, the report's words."""

    _kind = "power"

    def __init__(self, url: str, credentials: Credentials | None = None, name: str = "node_redfish",
                 chassis: str | None = None, ca_bundle: str | None = None, insecure: bool = False,
                 timeout_s: float = DEFAULT_TIMEOUT_S, min_read_interval_s: float = DEFAULT_MIN_READ_INTERVAL_S,
                 reading: RedfishReading | None = None) -> None:
        if not (isinstance(min_read_interval_s, (int, float)) and 0 <= min_read_interval_s <= 60):
            raise ValueError(f"min_read_interval_s must be in [0, 60] s, got {min_read_interval_s!r}")
        if credentials is not None and not isinstance(credentials, Credentials):
            raise TypeError("credentials must be a lightning_energy Credentials(user, password)")
        super().__init__(name, "node")
        self.client = RedfishClient(url, credentials, ca_bundle, insecure, timeout_s)
        self.chassis = chassis
        self.min_read_interval_s = float(min_read_interval_s) or None
        self.reading = reading
        self.source = self._source()

    def _source(self) -> str:
        where = self.reading.label if self.reading is not None else f"chassis {self.chassis or '(auto)'}"
        return f"Redfish {self.client.address} {where}; {self.client.tls}"

    def open(self) -> None:
        try:
            if self.reading is None or self.reading.kind != self._kind:
                self.reading = find_reading(self.client, self.chassis, self._kind)
        except BaseException:
            self.client.close()  # a sensor that cannot be opened is never closed by the sampler
            raise
        self.source = self._source()

    def close(self) -> None:
        self.client.close()

    def identity(self) -> tuple:
        return (*super().identity(), self.client.address, self.chassis)

    def describe(self) -> dict:
        return {**super().describe(), "bmc": self.client.address, "tls": self.client.tls,
                "min_read_interval_s": self.min_read_interval_s}

    def _resource(self) -> dict:
        if self.reading is None:
            raise RedfishError("sensor not opened")
        return self.client.get(self.reading.path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, bmc={self.client.address!r})"


class RedfishPowerSensor(_RedfishSensor):
    """The node's power (W) from ``EnvironmentMetrics.PowerWatts.Reading`` or
    ``Power.PowerControl[0].PowerConsumedWatts``: what the BMC last computed (its refresh: 1-10 s)."""

    def power_w(self) -> float:
        resource = self._resource()
        if self.reading.field == "PowerWatts":
            excerpt = resource.get("PowerWatts")
            value = excerpt.get("Reading") if isinstance(excerpt, dict) else None
        else:
            controls = resource.get("PowerControl")
            first = controls[0] if isinstance(controls, list) and controls else None
            value = first.get("PowerConsumedWatts") if isinstance(first, dict) else None
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise RedfishError(f"{self.reading.label}: no usable reading ({type(value).__name__})")
        return float(value)


class RedfishEnergySensor(_RedfishSensor):
    """The node's cumulative energy (J) from an ``EnergyJoules``/``EnergykWh`` counter of
    ``EnvironmentMetrics``. A counter that goes back (``ResetMetrics``, a BMC reboot) or whose
    ``SensorResetTime`` changes continues from where it was: the energy between the last read before the
    reset and the reset is lost (counted in :attr:`resets`). ``counter_resolution_J`` follows the finest
    step the BMC prints (decimals seen)."""

    _kind = "energy"

    def __init__(self, *args, update_period_s: float = DEFAULT_UPDATE_PERIOD_S, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not (isinstance(update_period_s, (int, float)) and 0 < update_period_s <= 60):
            raise ValueError(f"update_period_s must be in (0, 60] s, got {update_period_s!r}")
        self.counter_update_period_s = float(update_period_s)
        self.counter_resolution_J: float | None = self.reading.resolution_J if self.reading else None
        self.resets = 0
        self._offset_J = 0.0
        self._last_J: float | None = None
        self._reset_time: object = None

    def open(self) -> None:
        super().open()
        self.counter_resolution_J = self.reading.resolution_J

    def energy_j(self) -> float:
        resource = self._resource()
        excerpt = resource.get(self.reading.field)
        counter = _counter(resource, self.reading.field)
        if counter is None:
            raise RedfishError(f"{self.reading.label}: no usable counter reading")
        value_J = counter[0] * self.reading.unit_J
        step_J = counter[1] * self.reading.unit_J if counter[1] is not None else None
        if step_J is not None and (self.counter_resolution_J is None or step_J < self.counter_resolution_J):
            self.counter_resolution_J = step_J
        reset_time = excerpt.get("SensorResetTime") if "LifetimeReading" not in excerpt else None
        if self._last_J is not None and (value_J < self._last_J or reset_time != self._reset_time):
            self.resets += 1
            self._offset_J += self._last_J
        self._last_J, self._reset_time = value_J, reset_time
        return self._offset_J + value_J


def redfish_node_sensor(url: str, credentials: Credentials | None = None, reading: str = "auto",
                        update_period_s: float = DEFAULT_UPDATE_PERIOD_S, **kwargs) -> _RedfishSensor:
    """A Redfish node sensor of the kind the BMC offers: ``reading="auto"`` asks the BMC (one probe, each
    request bounded by ``timeout_s``) and returns a :class:`RedfishEnergySensor` for a fine counter, else a
    :class:`RedfishPowerSensor`; ``"energy"``/``"power"`` choose without asking (checked at ``open()``).
    Other arguments as the sensors'. Raises :class:`RedfishError` when the probe finds nothing."""
    if reading not in READINGS:
        raise ValueError(f"reading must be one of {READINGS}, got {reading!r}")
    if reading == "power":
        return RedfishPowerSensor(url, credentials, **kwargs)
    if reading == "energy":
        return RedfishEnergySensor(url, credentials, update_period_s=update_period_s, **kwargs)
    probe = RedfishClient(url, credentials, kwargs.get("ca_bundle"), kwargs.get("insecure", False),
                          kwargs.get("timeout_s", DEFAULT_TIMEOUT_S))
    try:
        found = find_reading(probe, kwargs.get("chassis"), "auto")
    finally:
        probe.close()
    if found.kind == "energy":
        return RedfishEnergySensor(url, credentials, update_period_s=update_period_s, reading=found, **kwargs)
    return RedfishPowerSensor(url, credentials, reading=found, **kwargs)
