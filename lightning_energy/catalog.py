"""The run catalog: an embedded SQLite file in the run root holding one record per fit.

A record holds the model name, parameter count, FLOPs per step (when known), hardware, precision,
batch size, steps, energy per sensor (J), time (s), CO2e (g), final metrics, checkpoint path and
config. Several processes may write at once: the file is in WAL mode, writers wait for each other
(``busy_timeout``) and each record is one ``BEGIN IMMEDIATE`` transaction, so nothing is lost.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
import sqlite3
import time
from contextlib import closing, contextmanager
from pathlib import Path

CATALOG_FILE = "energy_catalog.sqlite"
SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 60.0

# (column, SQL type) of the fits table after the id; the record dict uses the same keys.
FIT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("created_unix_s", "REAL NOT NULL"),
    ("run_dir", "TEXT"),
    ("model", "TEXT NOT NULL"),
    ("parameters", "INTEGER"),
    ("flops_per_step", "REAL"),
    ("hardware", "TEXT"),
    ("precision", "TEXT"),
    ("batch_size", "INTEGER"),
    ("steps", "INTEGER"),
    ("epochs", "INTEGER"),
    ("duration_s", "REAL"),
    ("energy_J", "REAL"),
    ("estimated", "INTEGER"),
    ("gCO2e", "REAL"),
    ("intensity_g_per_kWh", "REAL"),
    ("intensity_label", "TEXT"),
    ("pue", "REAL"),
    ("checkpoint_path", "TEXT"),
    ("metrics", "TEXT"),  # JSON object of final metrics
    ("config", "TEXT"),  # JSON object
)
JSON_COLUMNS = ("metrics", "config")
SENSOR_COLUMNS = ("rank", "sensor", "scope", "estimated", "source", "energy_J")

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS fits (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    {", ".join(f"{name} {kind}" for name, kind in FIT_COLUMNS)}
);
CREATE TABLE IF NOT EXISTS fit_sensors (
    fit_id INTEGER NOT NULL REFERENCES fits(id) ON DELETE CASCADE,
    rank INTEGER NOT NULL,
    sensor TEXT NOT NULL,
    scope TEXT,
    estimated INTEGER,
    source TEXT,
    energy_J REAL NOT NULL,
    PRIMARY KEY (fit_id, rank, sensor)
);
"""


class CatalogError(ValueError):
    """The catalog file is missing, not a catalog, or has no such record."""


class Catalog:
    """The SQLite run catalog at ``path`` (created on the first :meth:`add`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    @contextmanager
    def _connect(self, create: bool):
        if not create and not self.path.exists():
            raise CatalogError(f"no run catalog at {self.path}")
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        with closing(sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)) as conn:
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            conn.execute("PRAGMA foreign_keys = ON")
            try:
                if create:
                    _retry_while_locked(lambda: self._create(conn))
                elif conn.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
                    raise CatalogError(f"{self.path} is not a lightning-energy run catalog (schema version differs)")
            except sqlite3.OperationalError:
                raise
            except sqlite3.DatabaseError as err:
                raise CatalogError(f"{self.path} is not a lightning-energy run catalog ({err})") from None
            conn.row_factory = sqlite3.Row
            yield conn

    @staticmethod
    def _create(conn: sqlite3.Connection) -> None:
        if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            conn.execute("PRAGMA journal_mode = WAL")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version not in (0, SCHEMA_VERSION):
            raise CatalogError(f"run catalog schema version {version} is not supported (expected {SCHEMA_VERSION})")
        conn.execute("BEGIN IMMEDIATE")
        try:
            if conn.execute("PRAGMA user_version").fetchone()[0] == 0:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def ensure(self) -> None:
        """Create the file and its tables if needed (to fail early on an unwritable location)."""
        with self._connect(create=True):
            pass

    # ---------------------------------------------------------------- writing
    def add(self, record: dict) -> int:
        """Insert one fit (``record``: the FIT_COLUMNS keys plus ``sensors``); returns its id."""
        values = []
        for name, _ in FIT_COLUMNS:
            value = record.get(name)
            if name == "created_unix_s" and value is None:
                value = time.time()
            if name in JSON_COLUMNS:
                value = json.dumps(value if value is not None else {}, sort_keys=True, default=str)
            elif isinstance(value, bool):
                value = int(value)
            values.append(value)
        if not record.get("model"):
            raise CatalogError("a catalog record needs a `model` name")
        names = ", ".join(name for name, _ in FIT_COLUMNS)
        marks = ", ".join("?" for _ in FIT_COLUMNS)
        with self._connect(create=True) as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                fit_id = conn.execute(f"INSERT INTO fits ({names}) VALUES ({marks})", values).lastrowid
                conn.executemany(
                    "INSERT INTO fit_sensors (fit_id, rank, sensor, scope, estimated, source, energy_J) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [(fit_id, int(s.get("rank", 0)), s["name"], s.get("scope"), int(bool(s.get("estimated"))),
                      s.get("source"), float(s["energy_J"])) for s in record.get("sensors", [])],
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return int(fit_id)

    # ---------------------------------------------------------------- reading
    def list(self) -> list[dict]:
        """Every fit (without per-sensor rows), oldest first."""
        with self._connect(create=False) as conn:
            return [_fit_row(row) for row in conn.execute("SELECT * FROM fits ORDER BY id")]

    def get(self, fit_id: int) -> dict:
        """One fit with its ``sensors``; :class:`CatalogError` if there is none with that id."""
        with self._connect(create=False) as conn:
            row = conn.execute("SELECT * FROM fits WHERE id = ?", (fit_id,)).fetchone()
            if row is None:
                raise CatalogError(f"no fit with id {fit_id} in {self.path}")
            fit = _fit_row(row)
            fit["sensors"] = [
                {"rank": s["rank"], "name": s["sensor"], "scope": s["scope"], "estimated": bool(s["estimated"]),
                 "source": s["source"], "energy_J": s["energy_J"]}
                for s in conn.execute("SELECT * FROM fit_sensors WHERE fit_id = ? ORDER BY rank, sensor", (fit_id,))
            ]
        return fit

    def export_csv(self) -> str:
        """All fits as CSV text: the fit columns (JSON ones as JSON) and one ``energy_J:<sensor>`` column each."""
        fits = [self.get(f["id"]) for f in self.list()]
        sensor_columns = sorted({_sensor_key(s) for f in fits for s in f["sensors"]})
        header = ["id"] + [name for name, _ in FIT_COLUMNS] + [f"energy_J:{k}" for k in sensor_columns]
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(header)
        for fit in fits:
            per_sensor = {_sensor_key(s): s["energy_J"] for s in fit["sensors"]}
            row = [fit["id"]]
            for name, _ in FIT_COLUMNS:
                value = fit[name]
                if name in JSON_COLUMNS:
                    value = json.dumps(value, sort_keys=True)
                row.append("" if value is None else value)
            row += [per_sensor.get(k, "") for k in sensor_columns]
            writer.writerow(row)
        return out.getvalue()


def _retry_while_locked(action) -> None:
    """Run ``action``, retrying while another process holds the lock SQLite needs (switching to WAL
    takes an exclusive lock that does not wait through ``busy_timeout``)."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            return action()
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) and "busy" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(0.005 + random.random() * 0.02)


def _fit_row(row: sqlite3.Row) -> dict:
    fit = dict(row)
    for name in JSON_COLUMNS:
        fit[name] = json.loads(fit[name]) if fit[name] else {}
    fit["estimated"] = bool(fit["estimated"]) if fit["estimated"] is not None else None
    return fit


def _sensor_key(sensor: dict) -> str:
    return sensor["name"] if sensor["rank"] == 0 else f"{sensor['name']}@rank{sensor['rank']}"


def find_catalog(root: str | os.PathLike | None = None, path: str | os.PathLike | None = None) -> Path:
    """The catalog file: ``path`` if given, else ``root/energy_catalog.sqlite``, else ./runs or ./ ."""
    if path is not None:
        return Path(path)
    if root is not None:
        return Path(root) / CATALOG_FILE
    for candidate in (Path("runs") / CATALOG_FILE, Path(CATALOG_FILE)):
        if candidate.exists():
            return candidate
    raise CatalogError(f"no run catalog found at runs/{CATALOG_FILE} or ./{CATALOG_FILE}; give --root or --catalog")
