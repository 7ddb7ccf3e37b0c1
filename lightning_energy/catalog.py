"""The run catalog: an embedded SQLite file in the run root holding one record per fit.

A record holds the model name, parameter count, FLOPs per step (when known), hardware, precision,
batch size, steps, energy per sensor (J), time (s), CO2e (g), final metrics, checkpoint path and
config. Several processes may write at once: the file is in WAL mode, writers wait for each other
(``busy_timeout``) and each record is one ``BEGIN IMMEDIATE`` transaction, so nothing is lost.

Every failure is a :class:`CatalogError` with one line naming the file and the cause: a damaged or
foreign file is a plain ``CatalogError``; a catalog that cannot be used now (locked by another process
past the timeout, read-only, a full disk, an I/O error, an uncreatable folder) is a
:class:`CatalogUnavailableError`, which is also an ``OSError``. No ``sqlite3`` exception escapes.
"""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import random
import sqlite3
import time
from contextlib import closing, contextmanager
from pathlib import Path

from lightning_energy.provenance import of_entry, of_report
from lightning_energy.units import MS_PER_S

RUN_ATTRIBUTES_FILE = "run_attributes.json"  # a fit's attributes in its log dir (CatalogCallback, sweep)
CATALOG_FILE = "energy_catalog.sqlite"
SCHEMA_VERSION = 2  # 2: fits and fit_sensors carry `provenance` (measured / estimated / simulated)
READABLE_VERSIONS = (1, SCHEMA_VERSION)  # a version-1 catalog is read as is and upgraded on the next write
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
    ("provenance", "TEXT"),  # of energy_J: measured, estimated, simulated or a mix (lightning_energy.provenance)
    ("gCO2e", "REAL"),
    ("intensity_g_per_kWh", "REAL"),
    ("intensity_label", "TEXT"),
    ("pue", "REAL"),
    ("checkpoint_path", "TEXT"),
    ("metrics", "TEXT"),  # JSON object of final metrics
    ("config", "TEXT"),  # JSON object
)
JSON_COLUMNS = ("metrics", "config")
SENSOR_COLUMNS = ("rank", "sensor", "scope", "estimated", "provenance", "source", "energy_J")
SENSOR_COLUMN_TYPES = {"rank": "INTEGER NOT NULL", "sensor": "TEXT NOT NULL", "scope": "TEXT", "estimated": "INTEGER",
                       "provenance": "TEXT", "source": "TEXT", "energy_J": "REAL NOT NULL"}  # as in _SCHEMA

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
    provenance TEXT,
    source TEXT,
    energy_J REAL NOT NULL,
    PRIMARY KEY (fit_id, rank, sensor)
);
"""
# version 1 -> 2: the provenance columns; rows written before say estimated or measured, as they were labelled
_UPGRADE_FROM_1 = """
ALTER TABLE fits ADD COLUMN provenance TEXT;
ALTER TABLE fit_sensors ADD COLUMN provenance TEXT;
UPDATE fits SET provenance = CASE WHEN estimated THEN 'estimated' ELSE 'measured' END;
UPDATE fit_sensors SET provenance = CASE WHEN estimated THEN 'estimated' ELSE 'measured' END
"""


class CatalogError(ValueError):
    """The catalog file is missing, not a catalog (or damaged), has no such record, or cannot be used now."""


class CatalogUnavailableError(CatalogError, OSError):
    """The catalog cannot be read or written now: locked by another process past the timeout, read-only,
    a full disk, an I/O error. Also an ``OSError`` (``errno`` set where the cause maps to one)."""


# SQLite result codes (the primary code: the low byte of an extended one) -> (what it means, errno)
_UNAVAILABLE = {
    5: ("is locked by another process", errno.EBUSY),  # SQLITE_BUSY
    6: ("is locked by another process", errno.EBUSY),  # SQLITE_LOCKED
    8: ("is read-only", errno.EROFS),  # SQLITE_READONLY
    10: ("could not be read or written (I/O error)", errno.EIO),  # SQLITE_IOERR
    13: ("could not be written: the disk is full", errno.ENOSPC),  # SQLITE_FULL
    14: ("could not be opened", errno.EACCES),  # SQLITE_CANTOPEN
    15: ("could not be locked (the file system's locking failed)", errno.ENOLCK),  # SQLITE_PROTOCOL
    23: ("is not accessible (authorisation denied)", errno.EACCES),  # SQLITE_AUTH
}
_DAMAGED = {11, 26}  # SQLITE_CORRUPT, SQLITE_NOTADB


class Catalog:
    """The SQLite run catalog at ``path`` (created on the first :meth:`add`).

    ``timeout_s``: how long a writer waits for another one (default ``BUSY_TIMEOUT_S``); past it the
    call raises :class:`CatalogUnavailableError`.
    """

    def __init__(self, path: str | os.PathLike, timeout_s: float | None = None) -> None:
        self.path = Path(path)
        if timeout_s is not None and not timeout_s >= 0:
            raise ValueError(f"timeout_s must be a non-negative number of seconds, got {timeout_s!r}")
        self.timeout_s = timeout_s

    @property
    def _timeout_s(self) -> float:
        return BUSY_TIMEOUT_S if self.timeout_s is None else float(self.timeout_s)

    @contextmanager
    def _errors(self, doing: str):
        """Turn any sqlite3 or OS error while ``doing`` into one :class:`CatalogError` line."""
        try:
            yield
        except CatalogError:
            raise
        except sqlite3.Error as err:
            raise _catalog_error(self.path, doing, err, self._timeout_s) from None
        except OSError as err:
            raise _unavailable(f"run catalog {self.path}: {doing} failed ({_one_line(err)})", err.errno) from None

    @contextmanager
    def _connect(self, create: bool):
        if not create and not self.path.exists():
            raise CatalogError(f"no run catalog at {self.path}")
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        timeout_s = self._timeout_s
        with closing(self._open(create, timeout_s)) as conn:
            conn.execute(f"PRAGMA busy_timeout = {int(timeout_s * MS_PER_S)}")
            conn.execute("PRAGMA foreign_keys = ON")
            try:
                if create:
                    _retry_while_locked(lambda: self._create(conn), timeout_s)
                elif conn.execute("PRAGMA user_version").fetchone()[0] not in READABLE_VERSIONS:
                    raise CatalogError(f"{self.path} is not a lightning-energy run catalog (schema version differs)")
            except sqlite3.OperationalError:
                raise
            except sqlite3.DatabaseError as err:
                if _code(err) in _UNAVAILABLE:
                    raise
                raise CatalogError(f"{self.path} is not a lightning-energy run catalog ({_one_line(err)})") from None
            conn.row_factory = sqlite3.Row
            yield conn

    def _open(self, create: bool, timeout_s: float) -> sqlite3.Connection:
        """A connection; for reading, a catalog SQLite cannot open as usual because its folder or file is
        read-only (WAL mode needs its ``-shm`` file) is opened read-only and ``immutable`` (nobody can be
        writing to it there), so ``list``/``show``/``export`` work on a read-only copy."""
        conn = sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None)
        if create or os.access(self.path, os.W_OK) and os.access(self.path.parent, os.W_OK | os.X_OK):
            return conn
        try:
            conn.execute("PRAGMA user_version").fetchone()
            return conn
        except sqlite3.OperationalError as err:
            if _code(err) not in (8, 14):  # SQLITE_READONLY, SQLITE_CANTOPEN
                conn.close()
                raise
        conn.close()
        uri = f"{self.path.resolve().as_uri()}?mode=ro&immutable=1"
        return sqlite3.connect(uri, uri=True, timeout=timeout_s, isolation_level=None)

    @staticmethod
    def _create(conn: sqlite3.Connection) -> None:
        if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            conn.execute("PRAGMA journal_mode = WAL")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version not in (0, *READABLE_VERSIONS):
            raise CatalogError(f"run catalog schema version {version} is not supported (expected {SCHEMA_VERSION})")
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]  # another writer may have moved it
            if version != SCHEMA_VERSION:
                for statement in (_SCHEMA if version == 0 else _UPGRADE_FROM_1).split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            _rollback(conn)
            raise

    def ensure(self) -> None:
        """Create the file and its tables if needed (to fail early on an unwritable location).

        Raises :class:`CatalogUnavailableError` (an ``OSError``) or :class:`CatalogError`."""
        with self._errors("opening the catalog"), self._connect(create=True):
            pass

    # ---------------------------------------------------------------- writing
    def add(self, record: dict) -> int:
        """Insert one fit (``record``: the FIT_COLUMNS keys plus ``sensors``); returns its id.

        Raises :class:`CatalogError` (nothing written) when it cannot: :class:`CatalogUnavailableError`
        when the catalog is locked, read-only, on a full disk, ...; a plain one when it is damaged.
        """
        values = []
        for name, _ in FIT_COLUMNS:
            value = record.get(name)
            if name == "created_unix_s" and value is None:
                value = time.time()
            if name == "provenance":
                value = of_report(record)
            if name in JSON_COLUMNS:
                value = json.dumps(value if value is not None else {}, sort_keys=True, default=str)
            elif isinstance(value, bool):
                value = int(value)
            values.append(value)
        if not record.get("model"):
            raise CatalogError("a catalog record needs a `model` name")
        names = ", ".join(name for name, _ in FIT_COLUMNS)
        marks = ", ".join("?" for _ in FIT_COLUMNS)
        with self._errors("adding a fit"), self._connect(create=True) as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                fit_id = conn.execute(f"INSERT INTO fits ({names}) VALUES ({marks})", values).lastrowid
                conn.executemany(
                    "INSERT INTO fit_sensors (fit_id, rank, sensor, scope, estimated, provenance, source, energy_J) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [(fit_id, int(s.get("rank", 0)), s["name"], s.get("scope"), int(bool(s.get("estimated"))),
                      of_entry(s), s.get("source"), float(s["energy_J"])) for s in record.get("sensors", [])],
                )
                conn.execute("COMMIT")
            except BaseException:
                _rollback(conn)
                raise
        return int(fit_id)

    # ---------------------------------------------------------------- reading
    def list(self) -> list[dict]:
        """Every fit (without per-sensor rows), oldest first."""
        with self._errors("listing fits"), self._connect(create=False) as conn:
            return [_fit_row(row, self.path) for row in conn.execute("SELECT * FROM fits ORDER BY id")]

    def get(self, fit_id: int) -> dict:
        """One fit with its ``sensors``; :class:`CatalogError` if there is none with that id."""
        with self._errors(f"reading fit {fit_id}"), self._connect(create=False) as conn:
            row = conn.execute("SELECT * FROM fits WHERE id = ?", (fit_id,)).fetchone()
            if row is None:
                raise CatalogError(f"no fit with id {fit_id} in {self.path}")
            fit = _fit_row(row, self.path)
            fit["sensors"] = [
                _sensor_row(s, self.path, fit_id)
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


def _retry_while_locked(action, timeout_s: float | None = None) -> None:
    """Run ``action``, retrying while another process holds the lock SQLite needs (switching to WAL
    takes an exclusive lock that does not wait through ``busy_timeout``)."""
    deadline = time.monotonic() + (BUSY_TIMEOUT_S if timeout_s is None else timeout_s)
    while True:
        try:
            return action()
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) and "busy" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(0.005 + random.random() * 0.02)


def _rollback(conn: sqlite3.Connection) -> None:
    """Roll back if a transaction is open; never hides the error being handled (SQLite may have rolled back)."""
    try:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
    except sqlite3.Error:
        pass


def _code(err: sqlite3.Error) -> int | None:
    code = getattr(err, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _unavailable(message: str, errno_: int | None) -> CatalogUnavailableError:
    err = CatalogUnavailableError(message)
    err.errno = errno_
    return err


def _catalog_error(path: Path, doing: str, err: sqlite3.Error, timeout_s: float) -> CatalogError:
    """One line for ``err`` met while ``doing``: unavailable (locked, read-only, full, ...) or damaged."""
    code, detail = _code(err), _one_line(err)
    if code is None:  # older Pythons: classify by SQLite's message
        text = detail.lower()
        code = (5 if "locked" in text or "busy" in text else 8 if "readonly" in text or "read-only" in text
                else 13 if "full" in text else 14 if "unable to open" in text
                else 11 if "malformed" in text else 26 if "not a database" in text else None)
    if code in _UNAVAILABLE:
        meaning, errno_ = _UNAVAILABLE[code]
        if code in (5, 6):
            meaning += f" (waited {timeout_s:g} s)"
        return _unavailable(f"run catalog {path} {meaning}: {doing} failed ({detail})", errno_)
    if code in _DAMAGED:
        return CatalogError(f"run catalog {path} is damaged or not a lightning-energy run catalog: "
                            f"{doing} failed ({detail})")
    return CatalogError(f"run catalog {path}: {doing} failed ({type(err).__name__}: {detail})")


def _fit_row(row: sqlite3.Row, path: Path) -> dict:
    """A fits row as a record, every column checked against the type :data:`FIT_COLUMNS` declares for it:
    SQLite keeps whatever a damaged or crafted file holds (a number or bytes in a text column, a column
    declared without a type), so nothing downstream meets a value of the wrong type."""
    fit = dict(row)
    damaged = f"run catalog {path}: fit {fit.get('id')} is damaged"
    for name, declared in (("id", "INTEGER NOT NULL"), *FIT_COLUMNS):
        problem = _type_problem(fit.get(name), declared)
        if problem:
            raise CatalogError(f"{damaged}: its `{name}` {problem}")
    for name in JSON_COLUMNS:
        try:
            fit[name] = json.loads(fit[name]) if fit[name] else {}
        except (TypeError, ValueError, RecursionError):
            fit[name] = None
        if not isinstance(fit[name], dict):
            raise CatalogError(f"{damaged}: its `{name}` is not a JSON object")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in fit["metrics"].values()):
        raise CatalogError(f"{damaged}: its `metrics` are not all numbers")
    fit["estimated"] = bool(fit["estimated"]) if fit["estimated"] is not None else None
    try:
        fit["provenance"] = of_report({"provenance": fit.get("provenance"), "estimated": fit["estimated"]})
    except ValueError as err:  # a provenance such as "measured+bogus"
        raise CatalogError(f"{damaged}: its `provenance` {fit.get('provenance')!r} is not one ({err})") from None
    return fit


def _sensor_row(row: sqlite3.Row, path: Path, fit_id: int) -> dict:
    """A fit_sensors row as a sensor entry, each column checked against its declared type."""
    values = dict(row)
    for name, declared in SENSOR_COLUMN_TYPES.items():
        problem = _type_problem(values.get(name), declared)
        if problem:
            raise CatalogError(f"run catalog {path}: fit {fit_id} is damaged: sensor row "
                               f"{values.get('sensor')!r} (rank {values.get('rank')!r}): its `{name}` {problem}")
    try:
        provenance = of_entry(values)
    except ValueError as err:
        raise CatalogError(f"run catalog {path}: fit {fit_id} is damaged: sensor {values['sensor']!r}: "
                           f"its `provenance` {values['provenance']!r} is not one ({err})") from None
    return {"rank": values["rank"], "name": values["sensor"], "scope": values["scope"],
            "estimated": bool(values["estimated"]), "provenance": provenance, "source": values["source"],
            "energy_J": values["energy_J"]}


# Python types a column of each declared SQL type may hold (REAL columns also take whole numbers)
_PYTHON_TYPES = {"TEXT": (str,), "INTEGER": (int,), "REAL": (int, float)}
_TYPE_WORDS = {"TEXT": "text", "INTEGER": "an integer", "REAL": "a number"}


def _type_problem(value, declared: str) -> str | None:
    """What is wrong with ``value`` for a column declared ``declared`` (``"REAL NOT NULL"``), or None."""
    kind = declared.split()[0]
    if value is None:
        return "is empty" if "NOT NULL" in declared else None
    if isinstance(value, _PYTHON_TYPES[kind]) and not isinstance(value, bool):
        return None
    shown = repr(value if len(repr(value)) <= 40 else f"{repr(value)[:37]}...")
    return f"is {type(value).__name__} {shown}, not {_TYPE_WORDS[kind]}"


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
