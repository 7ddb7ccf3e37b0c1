"""The SQLite run catalog: round trip, concurrent writers, CatalogCallback, checkpoint metadata, CLI."""

from __future__ import annotations

import csv
import io
import json
import multiprocessing
import re
import sqlite3

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from conftest import TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy import SimulatedSensor
from lightning_energy.callbacks.carbon import CarbonCallback
from lightning_energy.callbacks.catalog import CHECKPOINT_KEY, RUN_ATTRIBUTES_FILE, CatalogCallback
from lightning_energy.catalog import CATALOG_FILE, Catalog, CatalogError
from lightning_energy.cli.main import main

WATTS = {"device": 120.0, "host": 30.0}


def record(model: str = "pkg.Model", **overrides) -> dict:
    base = {
        "created_unix_s": 1.7e9, "run_dir": "/runs/a", "model": model, "parameters": 1234, "flops_per_step": 5.5e6,
        "hardware": "cpu x1; cpu: test", "precision": "bf16-mixed", "batch_size": 512, "steps": 100, "epochs": 2,
        "duration_s": 12.5, "energy_J": 1500.0, "estimated": False, "gCO2e": 0.2, "intensity_g_per_kWh": 475.0,
        "intensity_label": "world average", "pue": 1.2, "checkpoint_path": "/runs/a/last.ckpt",
        "metrics": {"val/loss": 0.25}, "config": {"lr": 0.001, "layers": [200, 100]},
        "sensors": [{"name": "gpu0", "rank": 0, "scope": "device", "estimated": False, "source": "NVML",
                     "energy_J": 1200.0},
                    {"name": "rapl", "rank": 0, "scope": "host", "estimated": False, "source": "RAPL",
                     "energy_J": 300.0}],
    }
    base.update(overrides)
    return base


def test_round_trip(tmp_path):
    catalog = Catalog(tmp_path / CATALOG_FILE)
    first = catalog.add(record())
    second = catalog.add(record("pkg.Other", estimated=True, flops_per_step=None, sensors=[]))
    assert (first, second) == (1, 2)
    fit = catalog.get(first)
    expected = record()
    for key, value in expected.items():
        if key != "sensors":
            assert fit[key] == value, key
    assert fit["sensors"] == [{**s, "provenance": "measured"} for s in expected["sensors"]]
    assert fit["provenance"] == "measured"
    listed = catalog.list()
    assert [f["id"] for f in listed] == [1, 2]
    assert listed[1]["estimated"] is True and listed[1]["flops_per_step"] is None
    assert listed[1]["provenance"] == "estimated"  # a record without sensors: from its `estimated` flag
    rows = list(csv.DictReader(io.StringIO(catalog.export_csv())))
    assert [r["model"] for r in rows] == ["pkg.Model", "pkg.Other"]
    assert rows[0]["energy_J:gpu0"] == "1200.0" and rows[1]["energy_J:gpu0"] == ""
    assert json.loads(rows[0]["config"]) == {"lr": 0.001, "layers": [200, 100]}
    assert sqlite3.connect(tmp_path / CATALOG_FILE).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(CatalogError, match="no run catalog"):
        Catalog(tmp_path / "missing.sqlite").list()
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_text("this is not a database, " * 100)
    with pytest.raises(CatalogError, match="not a lightning-energy run catalog"):
        Catalog(garbage).list()
    catalog = Catalog(tmp_path / CATALOG_FILE)
    catalog.add(record())
    with pytest.raises(CatalogError, match="no fit with id 7"):
        catalog.get(7)
    with pytest.raises(CatalogError, match="model"):
        catalog.add(record(model=""))
    assert len(catalog.list()) == 1  # the rejected record left nothing behind


def _writer(path: str, worker: int, count: int, barrier, wrote) -> None:
    barrier.wait()
    catalog = Catalog(path)
    for i in range(count):
        catalog.add(record(f"worker{worker}.fit{i}"))
        if i == 0:  # on a busy machine one writer could otherwise finish before the other starts
            wrote[worker].set()
            if not wrote[1 - worker].wait(timeout=60):
                raise SystemExit(f"worker {worker}: the other writer never committed while this one was writing")


def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    path, count = str(tmp_path / CATALOG_FILE), 60
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2)
    wrote = [context.Event(), context.Event()]
    workers = [context.Process(target=_writer, args=(path, w, count, barrier, wrote)) for w in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert [w.exitcode for w in workers] == [0, 0]
    fits = Catalog(path).list()
    assert len(fits) == 2 * count
    assert sorted(f["id"] for f in fits) == list(range(1, 2 * count + 1))
    assert {f["model"] for f in fits} == {f"worker{w}.fit{i}" for w in range(2) for i in range(count)}
    # in id (commit) order: each worker's rows in its own order, and the two really interleaved. Written one
    # after the other (e.g. a writer holding the file for its whole session), the ids would be one block per
    # worker (a single switch between workers); a row of one worker between two of the other's means it
    # committed while the other was writing.
    by_id = sorted(fits, key=lambda f: f["id"])
    writer = [f["model"].split(".")[0] for f in by_id]
    for w in range(2):
        assert [f["model"] for f in by_id if f["model"].startswith(f"worker{w}.")] == [
            f"worker{w}.fit{i}" for i in range(count)]
    switches = sum(a != b for a, b in zip(writer, writer[1:]))
    assert switches >= 2, f"the two writers never overlapped: {writer}"
    sensors = sqlite3.connect(path).execute("SELECT COUNT(*) FROM fit_sensors").fetchone()[0]
    assert sensors == 2 * 2 * count


# ---------------------------------------------------------------- CatalogCallback in fits
def sensors():
    return [SimulatedSensor("device", WATTS["device"]), SimulatedSensor("host", WATTS["host"], scope="host")]


def test_each_fit_is_recorded_and_each_checkpoint_says_what_it_cost(tmp_path):
    ckpt = tmp_path / "ckpt"
    catalog_cb = CatalogCallback(config={"experiment": "unit"}, sensors=sensors())
    carbon = CarbonCallback(intensity_g_per_kWh=300.0, pue=1.25, sensors=sensors(), verbose=False)
    trainer = L.Trainer(callbacks=[carbon, catalog_cb, ModelCheckpoint(dirpath=ckpt, save_last=True)],
                        **trainer_kwargs(tmp_path, max_epochs=2, enable_checkpointing=True))
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    fit = Catalog(tmp_path / CATALOG_FILE).get(catalog_cb.record_id)
    assert fit["model"] == "tiny_lightning.TinyRegressor" and fit["parameters"] == 17
    # one step of Linear(16 -> 1) on 16 rows: forward 2*16*16 FLOPs, weight gradient 2*16*16 FLOPs
    assert fit["flops_per_step"] == 1024
    assert (fit["precision"], fit["batch_size"], fit["steps"], fit["epochs"]) == ("32-true", 16, 20, 2)
    by_name = {s["name"]: s["energy_J"] for s in fit["sensors"]}
    assert by_name["device"] == pytest.approx(WATTS["device"] * fit["duration_s"], rel=1e-9)
    assert fit["energy_J"] == pytest.approx(sum(WATTS.values()) * fit["duration_s"], rel=1e-9)
    assert fit["gCO2e"] == pytest.approx(fit["energy_J"] / 3.6e6 * 300.0 * 1.25, rel=1e-12)
    assert fit["metrics"]["train/loss"] > 0 and "val/loss" in fit["metrics"]
    assert fit["config"]["run"] == {"experiment": "unit"} and fit["config"]["trainer"]["max_epochs"] == 2
    assert fit["checkpoint_path"].endswith(".ckpt")
    attributes = json.loads((tmp_path / "lightning_logs" / "version_0" / RUN_ATTRIBUTES_FILE).read_text())
    assert attributes["catalog_id"] == fit["id"] and attributes["experiment"] == "unit"

    stamped = torch.load(ckpt / "last.ckpt", weights_only=False)[CHECKPOINT_KEY]
    assert stamped["steps"] == 20 and stamped["model"] == "tiny_lightning.TinyRegressor"
    assert stamped["energy_J"] == pytest.approx(sum(WATTS.values()) * stamped["duration_s"], rel=1e-9)
    assert 0 < stamped["energy_J"] <= fit["energy_J"]
    assert stamped["gCO2e"] == pytest.approx(stamped["energy_J"] / 3.6e6 * 375.0, rel=1e-12)
    first_epoch = torch.load(next(ckpt.glob("epoch=1*.ckpt")), weights_only=False)[CHECKPOINT_KEY]
    assert first_epoch["energy_J"] == pytest.approx(stamped["energy_J"])  # both written after the last epoch


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_recorded_energy_continues_across_a_resume(tmp_path):
    ckpt = tmp_path / "ckpt"

    def fit(max_epochs, resume=None):
        callback = CatalogCallback(sensors=sensors(), count_flops=False)
        trainer = L.Trainer(callbacks=[callback, ModelCheckpoint(dirpath=ckpt, save_last=True)],
                            **trainer_kwargs(tmp_path, max_epochs=max_epochs, enable_checkpointing=True))
        trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48), ckpt_path=resume)
        return callback

    first = fit(1)
    saved = torch.load(ckpt / "last.ckpt", weights_only=False)[CHECKPOINT_KEY]
    second = fit(2, resume=ckpt / "last.ckpt")
    session_s = second.record["duration_s"] - saved["duration_s"]
    assert second.record["energy_J"] == pytest.approx(saved["energy_J"] + sum(WATTS.values()) * session_s, rel=1e-9)
    assert second.record["energy_J"] > first.record["energy_J"]
    assert second.record["flops_per_step"] is None
    assert [f["id"] for f in Catalog(tmp_path / CATALOG_FILE).list()] == [1, 2]


def test_unwritable_catalog_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    callback = CatalogCallback(catalog_path=blocker / "sub" / CATALOG_FILE, sensors=sensors())
    trainer = L.Trainer(callbacks=[callback], **trainer_kwargs(tmp_path, max_epochs=1))
    with pytest.raises((OSError, sqlite3.Error)):
        trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    assert trainer.global_step == 0


def _only_warning(record, match: str) -> str:
    mine = [w for w in record if "lightning-energy" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in mine]
    assert re.search(match, str(mine[0].message)), str(mine[0].message)
    return str(mine[0].message)


def test_a_damaged_catalog_never_fails_the_fit(tmp_path):
    """Before: the damaged file failed the fit at set-up (and a failing write at its end would have too)."""
    path = tmp_path / CATALOG_FILE
    path.write_text("this is not a database, " * 100)
    callback = CatalogCallback(sensors=sensors(), count_flops=False)
    trainer = L.Trainer(callbacks=[callback], **trainer_kwargs(tmp_path, max_epochs=2))
    with pytest.warns(UserWarning) as record:
        trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    assert trainer.current_epoch == 2 and trainer.state.finished
    message = _only_warning(record, r"fit not recorded in the catalog: .*energy_catalog.sqlite is not a "
                                    r"lightning-energy run catalog")
    assert callback.record_id is None and callback.problems == [message.split("catalog: ", 1)[1]]
    assert callback.record["energy_J"] > 0  # the record was made, only not stored
    attributes = json.loads((tmp_path / "lightning_logs" / "version_0" / RUN_ATTRIBUTES_FILE).read_text())
    assert attributes["catalog_id"] is None and attributes["model"] == "tiny_lightning.TinyRegressor"


def test_a_catalog_locked_past_the_timeout_never_fails_the_fit(tmp_path, monkeypatch):
    from lightning_energy.callbacks import catalog as catalog_callbacks

    monkeypatch.setattr(catalog_callbacks, "CATALOG_TIMEOUT_S", 0.2)
    path = tmp_path / CATALOG_FILE
    Catalog(path).add(record())
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process writing for longer than the callback waits
    try:
        callback = CatalogCallback(sensors=sensors(), count_flops=False)
        trainer = L.Trainer(callbacks=[callback], **trainer_kwargs(tmp_path, max_epochs=1))
        with pytest.warns(UserWarning) as record_:
            trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert trainer.current_epoch == 1 and trainer.state.finished
    _only_warning(record_, r"fit not recorded in the catalog: run catalog .* is locked by another process "
                           r"\(waited 0.2 s\)")
    assert callback.record_id is None and len(callback.problems) == 1
    assert [f["id"] for f in Catalog(path).list()] == [1]  # nothing half-written


# ---------------------------------------------------------------- the catalog command
def test_catalog_command_lists_shows_compares_and_exports(tmp_path, capsys):
    catalog = Catalog(tmp_path / CATALOG_FILE)
    catalog.add(record())
    catalog.add(record("pkg.Small", energy_J=750.0, duration_s=10.0))
    root = ["--root", str(tmp_path)]
    assert main(["catalog", "list", *root]) == 0
    out = capsys.readouterr().out
    assert "Model" in out and "Small" in out and "1500.00" in out
    assert main(["catalog", "show", "2", *root]) == 0
    out = capsys.readouterr().out
    assert "fit 2: pkg.Small" in out and "gpu0" in out and "val/loss" in out
    assert main(["catalog", "show", "1", "--json", *root]) == 0
    assert json.loads(capsys.readouterr().out)["energy_J"] == 1500.0
    assert main(["catalog", "compare", "1", "2", *root]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert lines["energy_J"].split()[-1] == "0.5"  # 750 / 1500
    assert main(["catalog", "export", str(tmp_path / "fits.csv"), *root]) == 0
    assert capsys.readouterr().out.startswith("wrote ")
    assert len(list(csv.DictReader(io.StringIO((tmp_path / "fits.csv").read_text())))) == 2
    assert main(["catalog", "export", "-", "--catalog", str(tmp_path / CATALOG_FILE)]) == 0
    assert capsys.readouterr().out.startswith("id,created_unix_s")


def test_catalog_command_errors(tmp_path, capsys):
    assert main(["catalog", "list", "--root", str(tmp_path)]) == 2
    assert "no run catalog" in capsys.readouterr().err
    Catalog(tmp_path / CATALOG_FILE).add(record())
    assert main(["catalog", "show", "9", "--root", str(tmp_path)]) == 2
    assert "no fit with id 9" in capsys.readouterr().err


@pytest.mark.slow
def test_ddp_fit_is_recorded_once_with_both_ranks(tmp_path, rank_zygote):
    import os
    from pathlib import Path

    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    script = Path(__file__).resolve().parent / "workbench_ddp_fit.py"
    run = rank_zygote.run(script, [tmp_path], tmp_path / "ranks", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    (fit,) = Catalog(tmp_path / CATALOG_FILE).list()
    fit = Catalog(tmp_path / CATALOG_FILE).get(fit["id"])
    owners = sorted((s["name"], s["rank"]) for s in fit["sensors"])
    assert owners == [("device", 0), ("device", 1), ("host", 0)]
    # the forecast is over the 1 J budget after the first epoch: rank zero decides, every rank stops
    assert fit["steps"] == 10 and fit["epochs"] == 1 and fit["config"]["trainer"]["world_size"] == 2
    stamped = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)[CHECKPOINT_KEY]
    assert len(stamped["sensors"]) == 3 and stamped["energy_J"] > 0
    (carbon_report,) = tmp_path.rglob("carbon_report.json")
    carbon = json.loads(carbon_report.read_text())
    assert [r["epoch"] for r in carbon["epochs"]] == [0]
    assert carbon["total_gCO2e"] == pytest.approx(carbon["total_J"] / 3.6e6 * 500.0, rel=1e-12)
    (forecast_report,) = tmp_path.rglob("forecast_report.json")
    forecast = json.loads(forecast_report.read_text())
    assert forecast["plan"]["total_batches"] == 20 and len(forecast["errors"]) == 1
    assert forecast["budget"]["stopped"] is True


def test_a_version_1_catalog_is_read_and_upgraded_with_the_provenance_it_had(tmp_path, capsys):
    import sqlite3

    path = tmp_path / CATALOG_FILE
    with sqlite3.connect(path) as conn:  # the schema before provenance, with one estimated fit
        conn.executescript("""
            CREATE TABLE fits (id INTEGER PRIMARY KEY AUTOINCREMENT, created_unix_s REAL NOT NULL, run_dir TEXT,
                model TEXT NOT NULL, parameters INTEGER, flops_per_step REAL, hardware TEXT, precision TEXT,
                batch_size INTEGER, steps INTEGER, epochs INTEGER, duration_s REAL, energy_J REAL, estimated INTEGER,
                gCO2e REAL, intensity_g_per_kWh REAL, intensity_label TEXT, pue REAL, checkpoint_path TEXT,
                metrics TEXT, config TEXT);
            CREATE TABLE fit_sensors (fit_id INTEGER NOT NULL REFERENCES fits(id) ON DELETE CASCADE,
                rank INTEGER NOT NULL, sensor TEXT NOT NULL, scope TEXT, estimated INTEGER, source TEXT,
                energy_J REAL NOT NULL, PRIMARY KEY (fit_id, rank, sensor));
            INSERT INTO fits (created_unix_s, model, energy_J, estimated, metrics, config)
                VALUES (1.7e9, 'pkg.Old', 42.0, 1, '{}', '{}');
            INSERT INTO fit_sensors VALUES (1, 0, 'cpu_estimate', 'host', 1, 'ESTIMATE', 42.0);
            PRAGMA user_version = 1;
        """)
    catalog = Catalog(path)
    assert catalog.list()[0]["provenance"] == "estimated"  # read as it is
    assert main(["catalog", "list", "--catalog", str(path)]) == 0
    assert "ESTIMATED" in capsys.readouterr().out
    new_id = catalog.add(record(sensors=[{"name": "sim", "rank": 0, "scope": "device", "estimated": False,
                                          "provenance": "simulated", "source": "simulated", "energy_J": 9.0}]))
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
    assert catalog.get(1)["sensors"][0]["provenance"] == "estimated"
    assert catalog.get(new_id)["provenance"] == "simulated"
    assert catalog.get(new_id)["sensors"][0]["provenance"] == "simulated"
