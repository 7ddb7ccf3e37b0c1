"""Node sensors a cluster admin turns on with environment variables, with no change to the training code.

Read by :func:`node_sensors_from_env` whenever sensors are auto-detected (every front end, local rank 0 of
each node):

========================================== ==========================================================
``LIGHTNING_ENERGY_REDFISH_URL``           the BMC's Redfish service, ``https://HOST[:PORT]``: turns Redfish on
``LIGHTNING_ENERGY_REDFISH_USER``          the BMC user
``LIGHTNING_ENERGY_REDFISH_PASSWORD_FILE`` a file holding the password (owner-only: mode 0600 or 0400)
``LIGHTNING_ENERGY_REDFISH_PASSWORD``      the password itself (prefer the file: environments leak)
``LIGHTNING_ENERGY_REDFISH_CHASSIS``       the chassis id to read (default: the node's, found)
``LIGHTNING_ENERGY_REDFISH_READING``       ``auto`` (default), ``energy`` or ``power``
``LIGHTNING_ENERGY_REDFISH_CA_BUNDLE``     a PEM file of CAs that sign the BMC's certificate
``LIGHTNING_ENERGY_REDFISH_INSECURE``      ``1``: no certificate check (the report says so)
``LIGHTNING_ENERGY_REDFISH_INTERVAL_S``    read at most this often (s, default 1)
``LIGHTNING_ENERGY_REDFISH_UPDATE_PERIOD_S`` the BMC counter's refresh period (s, default 2)
``LIGHTNING_ENERGY_REDFISH_TIMEOUT_S``     one request's bound (s, default 1.8)
``LIGHTNING_ENERGY_IPMI``                  ``1``: read DCMI power in-band (``/dev/ipmi0``)
``LIGHTNING_ENERGY_IPMI_HOST``             the BMC for IPMI over LAN (turns IPMI on)
``LIGHTNING_ENERGY_IPMI_USER`` / ``_PASSWORD_FILE`` / ``_PASSWORD``  as for Redfish
``LIGHTNING_ENERGY_IPMI_READING``          ``instantaneous`` (default) or ``average``
``LIGHTNING_ENERGY_IPMITOOL``              the ipmitool executable (default ``ipmitool``)
========================================== ==========================================================

A setting that is wrong (a password file others can read, a BMC that does not answer, no power reading)
gives one note (warned once, listed in the report) and no sensor: training goes on, measured without it.
No note holds a password.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Mapping

from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.measure.sensors.redfish import Credentials

PREFIX = "LIGHTNING_ENERGY_"
MAX_SECRET_BYTES = 4096
TRUE = ("1", "true", "yes", "on")


class NodeConfigError(ValueError):
    """A node sensor's settings cannot be used (never holds a secret)."""


def read_secret_file(path: str | os.PathLike) -> str:
    """The secret in ``path`` (its first line, stripped): a regular file of at most 4 KiB that only its owner
    may read (no group or other permission bits), else :class:`NodeConfigError`."""
    path = Path(path)
    try:
        info = path.stat()
    except OSError as err:
        raise NodeConfigError(f"password file {path}: {err.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise NodeConfigError(f"password file {path} is not a regular file")
    if info.st_mode & 0o077:
        raise NodeConfigError(f"password file {path} may be read by others (mode {stat.S_IMODE(info.st_mode):04o}); "
                              f"`chmod 600 {path}`")
    if info.st_size > MAX_SECRET_BYTES:
        raise NodeConfigError(f"password file {path} is larger than {MAX_SECRET_BYTES} bytes")
    try:
        with open(path, "rb") as handle:
            text = handle.read(MAX_SECRET_BYTES + 1).decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise NodeConfigError(f"password file {path}: cannot be read ({type(err).__name__})") from None
    lines = text.splitlines()
    secret = lines[0].strip() if lines else ""
    if not secret:
        raise NodeConfigError(f"password file {path} is empty")
    return secret


def credentials_from_env(kind: str, environ: Mapping[str, str]) -> Credentials | None:
    """``Credentials`` from ``LIGHTNING_ENERGY_<kind>_USER`` and ``..._PASSWORD_FILE`` (or ``..._PASSWORD``);
    None without a user."""
    user = environ.get(f"{PREFIX}{kind}_USER")
    if not user:
        return None
    password_file = environ.get(f"{PREFIX}{kind}_PASSWORD_FILE")
    if password_file:
        password = read_secret_file(password_file)
    else:
        password = environ.get(f"{PREFIX}{kind}_PASSWORD")
        if not password:
            raise NodeConfigError(f"{PREFIX}{kind}_USER is set but neither {PREFIX}{kind}_PASSWORD_FILE "
                                  f"nor {PREFIX}{kind}_PASSWORD")
    return Credentials(user, password)


def _seconds(environ: Mapping[str, str], key: str, default: float) -> float:
    raw = environ.get(PREFIX + key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise NodeConfigError(f"{PREFIX}{key} must be a number of seconds, got {raw!r}") from None
    if not math.isfinite(value) or value < 0:
        raise NodeConfigError(f"{PREFIX}{key} must be a number of seconds >= 0, got {raw!r}")
    return value


def redfish_from_env(environ: Mapping[str, str]) -> Sensor | None:
    """The Redfish node sensor the environment asks for (None: not asked). Asks the BMC which reading it
    offers (:func:`~lightning_energy.measure.sensors.redfish.redfish_node_sensor`)."""
    from lightning_energy.measure.sensors import redfish

    url = environ.get(PREFIX + "REDFISH_URL")
    if not url:
        return None
    reading = environ.get(PREFIX + "REDFISH_READING", "auto") or "auto"
    if reading not in redfish.READINGS:
        raise NodeConfigError(f"{PREFIX}REDFISH_READING must be one of {redfish.READINGS}, got {reading!r}")
    try:
        return redfish.redfish_node_sensor(
            url, credentials_from_env("REDFISH", environ), reading=reading,
            update_period_s=_seconds(environ, "REDFISH_UPDATE_PERIOD_S", redfish.DEFAULT_UPDATE_PERIOD_S),
            chassis=environ.get(PREFIX + "REDFISH_CHASSIS") or None,
            ca_bundle=environ.get(PREFIX + "REDFISH_CA_BUNDLE") or None,
            insecure=environ.get(PREFIX + "REDFISH_INSECURE", "").lower() in TRUE,
            timeout_s=_seconds(environ, "REDFISH_TIMEOUT_S", redfish.DEFAULT_TIMEOUT_S),
            min_read_interval_s=_seconds(environ, "REDFISH_INTERVAL_S", redfish.DEFAULT_MIN_READ_INTERVAL_S))
    except ValueError as err:  # the URL's form, a bound: the message names no secret
        raise NodeConfigError(f"{PREFIX}REDFISH_*: {err}") from None


def ipmi_from_env(environ: Mapping[str, str]) -> Sensor | None:
    """The DCMI node sensor the environment asks for (None: not asked)."""
    from lightning_energy.measure.sensors.ipmi import DEFAULT_MIN_READ_INTERVAL_S, DEFAULT_TIMEOUT_S, DcmiPowerSensor

    host = environ.get(PREFIX + "IPMI_HOST") or None
    if host is None and environ.get(PREFIX + "IPMI", "").lower() not in TRUE:
        return None
    try:
        return DcmiPowerSensor(
            reading=environ.get(PREFIX + "IPMI_READING", "instantaneous") or "instantaneous", host=host,
            credentials=credentials_from_env("IPMI", environ) if host else None,
            ipmitool=environ.get(PREFIX + "IPMITOOL", "ipmitool") or "ipmitool",
            timeout_s=_seconds(environ, "IPMI_TIMEOUT_S", DEFAULT_TIMEOUT_S),
            min_read_interval_s=_seconds(environ, "IPMI_INTERVAL_S", DEFAULT_MIN_READ_INTERVAL_S))
    except ValueError as err:
        raise NodeConfigError(f"{PREFIX}IPMI_*: {err}") from None


def node_sensors_from_env(environ: Mapping[str, str] | None = None) -> tuple[list[Sensor], list[str]]:
    """(node sensors, notes) from the environment (default ``os.environ``): Redfish first, then IPMI DCMI
    (the report's node figure is the first one's; a second one is listed beside it as a cross-check)."""
    from lightning_energy.measure.sensors.ipmi import DcmiError
    from lightning_energy.measure.sensors.redfish import RedfishError

    environ = os.environ if environ is None else environ
    sensors: list[Sensor] = []
    notes: list[str] = []
    for what, build in (("Redfish", redfish_from_env), ("IPMI DCMI", ipmi_from_env)):
        try:
            sensor = build(environ)
        except (NodeConfigError, RedfishError, DcmiError) as err:
            notes.append(f"the node's power cannot be read through {what} ({err}); the report has no node total "
                         "from it.")
            continue
        if sensor is not None:
            sensors.append(sensor)
    return sensors, notes
