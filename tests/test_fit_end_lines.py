"""At fit end each callback says, in one line on the ``lightning_energy`` logger, its headline figure (with the
joule's provenance) and where its output went: EnergyProfiler, FlopsCallback, CatalogCallback, PrecisionSwitch."""

from __future__ import annotations

import logging
import os
import shlex
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from conftest import TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy import SimulatedSensor
from lightning_energy.callbacks.catalog import CatalogCallback
from lightning_energy.callbacks.flops import FlopsCallback
from lightning_energy.callbacks.precision import PrecisionSwitch
from lightning_energy.callbacks.profiler import EnergyProfiler
from lightning_energy.cli.main import main as lightning_energy_main
from lightning_energy.optimize.precision.modes import MODE_LEGEND, MODE_NAMES
from power_limit_helpers import install_fake_time
from precision_helpers import SAMPLER_INTERVAL_S, FaultyRegressor, SimulatedModeCosts


def fit_end_lines(caplog, module: str, prefix: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == module and r.getMessage().startswith(prefix)]


def fit(tmp_path, callbacks, model=None, max_epochs=2, **overrides):
    trainer = L.Trainer(callbacks=callbacks, **trainer_kwargs(tmp_path, max_epochs=max_epochs, **overrides))
    trainer.fit(model or TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    return trainer


def test_energy_profiler_names_its_energy_and_the_folder_of_its_traces_and_tables(tmp_path, caplog):
    callback = EnergyProfiler(wait=0, warmup=1, active=2, sensors=[SimulatedSensor("device", 90.0)],
                              interval_s=0.002)
    with caplog.at_level(logging.INFO, logger="lightning_energy"):
        trainer = fit(tmp_path, [callback], max_epochs=1, logger=TensorBoardLogger(str(tmp_path), name="tb"))
    (line,) = fit_end_lines(caplog, "lightning_energy.callbacks.profiler", "EnergyProfiler: 1 profiled window")
    (window,) = callback.windows
    assert f"{window.window_J:.3g} J (SIMULATED)" in line and f"in {trainer.log_dir}" in line
    assert "op_energy_step*.csv" in line and "pt.trace.json" in line
    assert window.csv_path.parent == window.trace_path.parent == Path(trainer.log_dir)


def test_flops_callback_gives_flops_mfu_and_energy_per_gflop_and_the_table_path(tmp_path, caplog):
    callback = FlopsCallback(sensors=[SimulatedSensor("device", 50.0)])
    with caplog.at_level(logging.INFO, logger="lightning_energy"):
        fit(tmp_path, [callback])
    (line,) = fit_end_lines(caplog, "lightning_energy.callbacks.flops", "FlopsCallback:")
    table = callback.table
    assert table.train_FLOPs == 1024 and "1.02 kFLOP per training batch of 16 (forward 512 FLOP;" in line
    assert f"study MACs {table.study_MACs:,}: one forward pass as the Baler study counts it" in line
    assert "over 2 epochs: " in line and " % of the peak, fp32 " in line
    seconds = sum(e["steps_s"] for e in callback.epochs)
    mfu = sum(e["flops/mfu"] * e["steps_s"] for e in callback.epochs) / seconds
    assert f"MFU {100 * mfu:.3g} %" in line
    gflop = sum(e["flops/epoch_GFLOP"] for e in callback.epochs)
    joules = sum(e["steps_J"] for e in callback.epochs)
    assert f"{joules / gflop:.4g} J/GFLOP (SIMULATED)" in line
    assert line.endswith(f"table: {callback.table_path}") and callback.table_path.is_file()
    assert "study_MACs`` are the multiply-accumulates" in FlopsCallback.__doc__


def test_catalog_callback_prints_the_command_that_lists_the_fit_from_anywhere(tmp_path, caplog, capsys,
                                                                              monkeypatch):
    callback = CatalogCallback(sensors=[SimulatedSensor("device", 50.0)])
    root = tmp_path / "runs" / "experiment"  # not where `catalog list` looks by default
    with caplog.at_level(logging.INFO, logger="lightning_energy"):
        fit(tmp_path, [callback], default_root_dir=str(root))
    (line,) = fit_end_lines(caplog, "lightning_energy.callbacks.catalog", "CatalogCallback:")
    assert f"fit recorded as id {callback.record_id}: {callback.record['energy_J']:.4g} J (SIMULATED)" in line
    command = line.split("list it with: ", 1)[1]
    argv = shlex.split(command)
    assert argv[:3] == ["lightning-energy", "catalog", "list"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert lightning_energy_main(argv[1:]) == 0  # the command as printed, from another folder
    listed = capsys.readouterr().out
    assert "TinyRegressor" in listed and "SIMULATED" in listed


@pytest.mark.parametrize("verbose", [False, True])
def test_precision_switch_gives_the_final_mode_its_energy_the_report_and_what_code_means(tmp_path, caplog, capsys,
                                                                                           monkeypatch, verbose):
    clock = install_fake_time(monkeypatch.setattr)
    costs = SimulatedModeCosts(clock, {name: 1.0 if name == "bf16-mixed" else 1000.0 for name in MODE_NAMES})
    callback = PrecisionSwitch(sensors=[costs.counter], interval_s=SAMPLER_INTERVAL_S, candidates=["32-true",
                               "bf16-mixed"], warmup_steps=2, profile_steps=3, check_every_n_steps=2,
                               min_profile_rounds=1, noise_floor=False, verbose=verbose)
    with caplog.at_level(logging.INFO, logger="lightning_energy"):
        trainer = fit(tmp_path, [callback, costs], model=FaultyRegressor(sleep_s=0.0),
                      logger=CSVLogger(str(tmp_path), name="csv"))
    (line,) = fit_end_lines(caplog, "lightning_energy.callbacks.precision", "PrecisionSwitch: final mode")
    rows = {row["mode"]: row for row in callback.report["modes"]}
    energy_J = sum(row["trained_J"] for row in rows.values())
    assert line.startswith("PrecisionSwitch: final mode bf16-mixed (chosen bf16-mixed), ")
    assert f"{energy_J:.4g} J (" in line and f"over {trainer.global_step} trained steps" in line
    assert f"bf16-mixed {rows['bf16-mixed']['step_J']:.4g} J/step vs 32-true" in line
    assert f"report written to {callback.report_path}" in line and callback.report_path.is_file()
    assert f"(its column code: the mode as a number, as logged in precision/mode ({MODE_LEGEND}" in line
    printed = capsys.readouterr().out
    if verbose:  # the table's code column is explained under it
        assert " code " in printed and f"  code: the mode as a number, as logged in precision/mode ({MODE_LEGEND}" \
            in printed
    assert "PrecisionSwitch: final mode" not in printed and os.path.basename(str(callback.report_path))
