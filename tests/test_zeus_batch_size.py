"""ZeusBatchSizeOptimizer against Zeus's own BSO server on 127.0.0.1 with SQLite: three recurring fits.

The server runs as a separate process from ``lightning_energy/optimize/bso_server.py``, one for the session
(the ``bso_server`` fixture of ``bso_helpers``, provided by conftest).
"""

from __future__ import annotations

import socket
import sqlite3
import subprocess
import sys
import uuid

import lightning as L
import pytest
from bso_helpers import LAUNCHER
from conftest import trainer_kwargs
from lightning_energy.callbacks.zeus_batch_size import BSOServerError, ZeusBatchSizeOptimizer
from lightning_energy.simulate.gpu_sim import SimulatedGPU, SimulatedWorkload
from power_limit_helpers import ROWS, AccuracyModule, install_fake_time


def test_three_recurring_fits_honour_the_servers_batch_sizes(tmp_path, monkeypatch, bso_server):
    url, database = bso_server
    job_id = f"lightning-energy-test-{uuid.uuid4().hex[:8]}"
    decisions, energies = [], []
    for run in range(3):
        clock = install_fake_time(monkeypatch.setattr)
        gpu = SimulatedGPU(clock=clock)
        client = ZeusBatchSizeOptimizer(url, job_id_prefix="lightning-energy-test", job_id=job_id,
                                        batch_sizes=[32, 64, 128], default_batch_size=64, monitor="val/acc",
                                        target_metric=0.5, max_epochs=5, gpu=gpu)
        module = AccuracyModule()
        trainer = L.Trainer(callbacks=[client, SimulatedWorkload(gpu=gpu)],
                            **trainer_kwargs(tmp_path / f"run{run}", max_epochs=10, logger=False, num_sanity_val_steps=0))
        trainer.fit(module)
        b = client.batch_size
        decisions.append(b)
        assert set(module.trained_batches) == {b}  # the server's batch size is what trained
        assert trainer.current_epoch == 3  # the server stopped it when val/acc reached 0.5, not max_epochs=10
        assert [r["current_epoch"] for r in client.reports] == [1, 2, 3]
        assert client.outcome["converged"] is True and client.outcome["stop_train"] is True
        steps = 3 * (ROWS // b)
        assert client.reports[-1]["energy"] == pytest.approx(steps * gpu.step_energy_J(300, b), rel=1e-9)
        assert client.reports[-1]["time"] == pytest.approx(steps * gpu.step_time_s(300, b), rel=1e-9)
        energies.append(client.reports[-1]["energy"])
    assert decisions == [64, 32, 128]  # Zeus's pruning: the default, then smaller, then larger sizes
    with sqlite3.connect(database) as db:
        rows = db.execute("SELECT batch_size, status, converged, energy FROM Trial WHERE job_id = ? ORDER BY trial_number",
                          (job_id,)).fetchall()
    assert [(r[0], r[1], bool(r[2])) for r in rows] == [(64, "Succeeded", True), (32, "Succeeded", True),
                                                       (128, "Succeeded", True)]
    assert [r[3] for r in rows] == pytest.approx(energies, rel=1e-9)


def test_validation_within_epochs_reports_training_epochs(tmp_path, monkeypatch, bso_server):
    """val_check_interval=0.5: two reports per epoch carry the training epochs completed, not a report count."""
    url, _ = bso_server
    clock = install_fake_time(monkeypatch.setattr)
    gpu = SimulatedGPU(clock=clock)
    client = ZeusBatchSizeOptimizer(url, job_id_prefix="lightning-energy-test",
                                    job_id=f"lightning-energy-test-{uuid.uuid4().hex[:8]}", batch_sizes=[32, 64],
                                    default_batch_size=64, monitor="val/acc", target_metric=0.5, max_epochs=5, gpu=gpu)
    trainer = L.Trainer(callbacks=[client, SimulatedWorkload(gpu=gpu)], val_check_interval=0.5,
                        **trainer_kwargs(tmp_path, max_epochs=10, logger=False, num_sanity_val_steps=0))
    trainer.fit(AccuracyModule())
    # val/acc is 0.6 from epoch 2 on: the server stops at that epoch's first (mid-epoch) validation
    assert [r["current_epoch"] for r in client.reports] == [0, 1, 1, 2, 2]
    assert client.outcome["converged"] is True
    steps = 2 * (ROWS // 64) + ROWS // 64 // 2  # the last report: two epochs and a half
    assert client.reports[-1]["time"] == pytest.approx(steps * gpu.step_time_s(300, 64), rel=1e-9)


def test_state_dict_round_trip_resumes_the_trial_without_registering(tmp_path, monkeypatch, bso_server):
    url, _ = bso_server
    clock = install_fake_time(monkeypatch.setattr)
    gpu = SimulatedGPU(clock=clock)
    job = dict(job_id_prefix="lightning-energy-test", job_id=f"lightning-energy-test-{uuid.uuid4().hex[:8]}",
               batch_sizes=[32, 64], default_batch_size=64, monitor="val/acc", target_metric=0.5, max_epochs=5, gpu=gpu)
    first = ZeusBatchSizeOptimizer(url, **job)
    trainer = L.Trainer(callbacks=[first, SimulatedWorkload(gpu=gpu)],
                        **trainer_kwargs(tmp_path / "a", max_epochs=1, logger=False, num_sanity_val_steps=0))
    trainer.fit(AccuracyModule())
    (report,) = first.reports
    trial = {key: report[key] for key in ("job_id", "batch_size", "trial_number")}
    saved = first.state_dict()
    assert saved == {"trial": None, "time_s": report["time"], "energy_J": report["energy"]}  # trial closed at fit end
    # a checkpoint taken while the trial ran holds it: the resumed run keeps that trial and its totals
    saved["trial"] = trial
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens: any request to register a job would fail at once
    second = ZeusBatchSizeOptimizer(f"http://127.0.0.1:{port}", **{**job, "default_batch_size": 32}, timeout_s=2.0)
    second.load_state_dict(saved)
    assert second.state_dict() == saved
    module = AccuracyModule()
    trainer = L.Trainer(callbacks=[second, SimulatedWorkload(gpu=gpu)],
                        **trainer_kwargs(tmp_path / "b", max_epochs=1, logger=False, num_sanity_val_steps=0))
    with pytest.warns(UserWarning, match="could not close trial"), \
            pytest.raises(BSOServerError, match="cannot reach"):  # the first report, after a whole epoch
        trainer.fit(module)
    assert second.batch_size == 64 and module.trained_batches == [64] * (ROWS // 64)


def test_unreachable_server_fails_before_training_naming_the_launcher(tmp_path, monkeypatch):
    clock = install_fake_time(monkeypatch.setattr)
    gpu = SimulatedGPU(clock=clock)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens here once the socket is closed
    client = ZeusBatchSizeOptimizer(f"http://127.0.0.1:{port}", job_id_prefix="x", batch_sizes=[8, 16],
                                    default_batch_size=8, gpu=gpu, timeout_s=2.0)
    module = AccuracyModule()
    trainer = L.Trainer(callbacks=[client], **trainer_kwargs(tmp_path, logger=False, num_sanity_val_steps=0))
    with pytest.raises(BSOServerError, match="bso_server.py"):
        trainer.fit(module)
    assert module.trained_batches == []



def test_launcher_refuses_bad_arguments_without_starting(tmp_path):
    run = subprocess.run([sys.executable, str(LAUNCHER), "--port", "0", "--database", str(tmp_path / "db.sqlite3")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--port" in run.stderr
    assert not (tmp_path / "db.sqlite3").exists()


def test_cli_command_reports_a_bad_port_in_one_line(capsys):
    from lightning_energy.cli.main import main

    assert main(["bso-server", "--port", "70000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--port must be in 1..65535" in err[0]
