"""The whole node's power from its BMC through IPMI DCMI (``ipmitool dcmi power reading``), scope ``"node"``.

DCMI's Get Power Reading returns, in watts, the instantaneous reading, the minimum, maximum and average over
the BMC's sampling period (a rolling window, typically 1-5 s, printed as "Sampling period: 00000005
Seconds."), a timestamp and whether power measurement is active. ``ipmitool`` prints (1.8.x)::

    Instantaneous power reading:                   225 Watts
    Minimum during sampling period:                 10 Watts
    Maximum during sampling period:                330 Watts
    Average power reading over sample period:      223 Watts
    IPMI timestamp:                           Thu Jan  1 00:00:00 1970
    Sampling period:                          00000005 Seconds.
    Power reading state is:                   activated

:class:`DcmiPowerSensor` reads one of them, chosen by ``reading`` and named in its ``source`` (and so in the
report): ``"instantaneous"`` (default; follows the training's phases) or ``"average"`` (the BMC's rolling
mean over its sampling period: smoother, but it lags a change of power by about half that period, so
windows shorter than the period are smeared into their neighbours). Readings are whole watts.

In-band (``/dev/ipmi0``, root or the ``ipmi`` group) by default; over the LAN with ``host`` (``-I lanplus``),
the password passed to ipmitool through its environment (``-E``, ``IPMI_PASSWORD``), never on its command line
(which other users can see in ``ps``). Each read runs ipmitool once, bounded by ``timeout_s``; a non-zero exit,
a timeout, an unparsable output or a deactivated reading raises :class:`DcmiError` (counted by the sampler).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.measure.sensors.redfish import Credentials

DEFAULT_TIMEOUT_S = 1.8  # below the sampler's READ_TIMEOUT_S (2 s)
DEFAULT_MIN_READ_INTERVAL_S = 1.0  # DCMI readings refresh about once a second at best
MAX_OUTPUT_BYTES = 64 * 1024
READINGS = ("instantaneous", "average")
_LINE = re.compile(r"^\s*(?P<key>[A-Za-z][A-Za-z ]+?)\s*:\s*(?P<value>.*?)\s*$")
_WATTS = re.compile(r"^(\d+(?:\.\d+)?)\s*Watts?$", re.IGNORECASE)
_PERIOD = re.compile(r"^(\d+)\s*(Seconds|Milliseconds)\.?$", re.IGNORECASE)


class DcmiError(RuntimeError):
    """``ipmitool dcmi power reading`` gave no usable reading (never holds credentials)."""


@dataclass(frozen=True)
class DcmiReading:
    """One DCMI power reading: W, the sampling period (s; None if not printed), the state."""

    instantaneous_W: float
    minimum_W: float | None
    maximum_W: float | None
    average_W: float
    sampling_period_s: float | None
    active: bool


def parse_power_reading(text: str) -> DcmiReading:
    """Parse ``ipmitool dcmi power reading``'s output (raises :class:`DcmiError` if it is not one)."""
    values: dict[str, str] = {}
    for line in text.splitlines()[:64]:
        match = _LINE.match(line)
        if match:
            values[match["key"].strip().lower()] = match["value"]

    def watts(key: str, required: bool = True) -> float | None:
        raw = values.get(key)
        match = _WATTS.match(raw) if raw is not None else None
        if match is None:
            if required:
                raise DcmiError(f"ipmitool output has no {key!r} in watts")
            return None
        return float(match[1])

    period = None
    raw_period = values.get("sampling period")
    if raw_period is not None and (match := _PERIOD.match(raw_period)):
        period = int(match[1]) * (0.001 if match[2].lower().startswith("milli") else 1.0)
    state = values.get("power reading state is", "").lower()
    return DcmiReading(watts("instantaneous power reading"), watts("minimum during sampling period", False),
                       watts("maximum during sampling period", False),
                       watts("average power reading over sample period"), period, state != "deactivated")


class DcmiPowerSensor(Sensor):
    """The node's power (W) from ``ipmitool dcmi power reading``: its instantaneous or its average reading.

    Args:
        reading: ``"instantaneous"`` or ``"average"`` (over the BMC's sampling period; see the module).
        host: the BMC's address for IPMI over LAN (``-I lanplus``); None: in-band (``/dev/ipmi0``).
        credentials: user and password for ``host``.
        ipmitool: the ipmitool executable.
        interface: the ipmitool interface for ``host`` (``lanplus``, ``lan``).
        port: the BMC's RMCP port (623 by default).
        timeout_s: bound of one ipmitool run (s).
        min_read_interval_s: read at most this often (s).
    """

    def __init__(self, name: str = "node_dcmi", reading: str = "instantaneous", host: str | None = None,
                 credentials: Credentials | None = None, ipmitool: str = "ipmitool", interface: str = "lanplus",
                 port: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 min_read_interval_s: float = DEFAULT_MIN_READ_INTERVAL_S) -> None:
        if reading not in READINGS:
            raise ValueError(f"reading must be one of {READINGS}, got {reading!r}")
        if host is not None and not re.fullmatch(r"[A-Za-z0-9_.:\-\[\]]{1,253}", host):
            raise ValueError("host must be a host name or an IP address")
        if interface not in ("lanplus", "lan"):
            raise ValueError(f"interface must be 'lanplus' or 'lan', got {interface!r}")
        if port is not None and not (isinstance(port, int) and 0 < port < 65536):
            raise ValueError(f"port must be in 1..65535, got {port!r}")
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= 60):
            raise ValueError(f"timeout_s must be in (0, 60] s, got {timeout_s!r}")
        if credentials is not None and not isinstance(credentials, Credentials):
            raise TypeError("credentials must be a lightning_energy Credentials(user, password)")
        super().__init__(name, "node")
        self.reading, self.host, self.credentials = reading, host, credentials
        self.ipmitool, self.interface, self.port = ipmitool, interface, port
        self.timeout_s = float(timeout_s)
        self.min_read_interval_s = float(min_read_interval_s) or None
        self.sampling_period_s: float | None = None
        self.source = self._source()

    def _source(self) -> str:
        where = f"BMC {self.host} (IPMI over LAN, {self.interface})" if self.host else "in-band BMC"
        if self.reading == "average":
            period = f"{self.sampling_period_s:g} s" if self.sampling_period_s else "its"
            what = f"average power over the BMC's {period} sampling period (a rolling mean: lags by half of it)"
        else:
            what = "instantaneous power reading"
        return f"IPMI DCMI power reading, {what}, {where}, via {os.path.basename(self.ipmitool)}"

    def command(self) -> list[str]:
        """The ipmitool command line (never holds the password)."""
        cmd = [self.ipmitool]
        if self.host is not None:
            cmd += ["-I", self.interface, "-H", self.host]
            if self.port is not None:
                cmd += ["-p", str(self.port)]
            if self.credentials is not None:
                cmd += ["-U", self.credentials.user, "-E"]
        return cmd + ["dcmi", "power", "reading"]

    def read(self) -> DcmiReading:
        """One DCMI reading (runs ipmitool once). Raises :class:`DcmiError`."""
        env = dict(os.environ)
        env.pop("IPMI_PASSWORD", None)
        if self.credentials is not None:
            env["IPMI_PASSWORD"] = self.credentials.password
        try:
            done = subprocess.run(self.command(), capture_output=True, timeout=self.timeout_s, env=env,
                                  stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired:
            raise DcmiError(f"ipmitool gave no power reading within {self.timeout_s:g} s") from None
        except OSError as err:
            raise DcmiError(f"cannot run {self.ipmitool!r}: {type(err).__name__}: {err.strerror}") from None
        out = done.stdout[:MAX_OUTPUT_BYTES].decode("utf-8", "replace")
        if done.returncode != 0:
            first = next((line.strip() for line in done.stderr[:MAX_OUTPUT_BYTES].decode("utf-8", "replace")
                          .splitlines() if line.strip()), "no message")
            if self.credentials is not None:
                first = first.replace(self.credentials.password, "<hidden>")
            raise DcmiError(f"ipmitool exited with {done.returncode}: {first[:200]}")
        reading = parse_power_reading(out)
        if not reading.active:
            raise DcmiError("the BMC's power measurement is deactivated (`ipmitool dcmi power activate` turns "
                            "it on where the BMC measures power)")
        return reading

    def open(self) -> None:
        reading = self.read()  # a BMC without DCMI power, or a wrong password, is found here
        self.sampling_period_s = reading.sampling_period_s
        self.source = self._source()

    def power_w(self) -> float:
        reading = self.read()
        return reading.average_W if self.reading == "average" else reading.instantaneous_W

    def identity(self) -> tuple:
        return (*super().identity(), self.host, self.reading)

    def describe(self) -> dict:
        return {**super().describe(), "reading": self.reading, "bmc": self.host or "in-band",
                "sampling_period_s": self.sampling_period_s, "min_read_interval_s": self.min_read_interval_s}

    def __repr__(self) -> str:
        return f"DcmiPowerSensor(name={self.name!r}, reading={self.reading!r}, host={self.host!r})"
