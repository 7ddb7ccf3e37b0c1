"""EnergyCallback in real Lightning fits with simulated sensors of known power."""

from __future__ import annotations

import csv
import json
import threading
import time

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from conftest import EPOCHS, ROWS, FakeTimeSteps, RecordingLogger, TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy import EnergyCallback, SimulatedSensor
from lightning_energy.outputs.report import format_report
from lightning_energy.outputs.trace import read_trace

DEVICE_W, HOST_W = 120.0, 30.0
STEPS = EPOCHS * ROWS // 16  # the default fit's optimizer steps (tiny_loader: batches of 16)
VALIDATION_STEP_S = 0.1
PUBLIC_METRICS = [
    "energy/step_J", "energy/epoch_J", "energy/total_J", "power/step_W", "power/epoch_W", "time/step_s",
    "time/epoch_s", "edp/epoch_Js", "energy/sensor/device/epoch_J", "energy/sensor/host/epoch_J", "energy/val_epoch_J",
]


def simulated_sensors(**device_kwargs):
    return [SimulatedSensor("device", DEVICE_W, **device_kwargs), SimulatedSensor("host", HOST_W, scope="host")]


def fit(tmp_path, callback, logger=None, **overrides):
    trainer = L.Trainer(callbacks=[callback], logger=logger if logger is not None else True,
                        **trainer_kwargs(tmp_path, **overrides))
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    return trainer


def tensorboard_scalars(log_dir) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_holds_every_metric_beside_the_loss(tmp_path):
    # epochs of >= 200 ms sampled at 100 Hz: enough samples for a power figure (shorter epochs get none)
    callback = EnergyCallback(sensors=simulated_sensors(), verbose=False, interval_s=0.01)
    trainer = L.Trainer(callbacks=[callback], logger=TensorBoardLogger(str(tmp_path), name="tb"),
                        **trainer_kwargs(tmp_path))
    trainer.fit(SlowSteps(), tiny_loader(), tiny_loader(n=48))
    acc = tensorboard_scalars(trainer.log_dir)
    tags = set(acc.Tags()["scalars"])
    missing = [m for m in PUBLIC_METRICS + ["train/loss"] if m not in tags]
    assert not missing, f"missing from TensorBoard: {missing}; have {sorted(tags)}"
    step_events = acc.Scalars("energy/step_J")
    loss_steps = {e.step for e in acc.Scalars("train/loss")}
    assert {e.step for e in step_events} <= loss_steps  # energy sits on the loss's step axis
    assert len(step_events) == STEPS // 2  # log_every_n_steps=2
    assert all(e.value > 0 for e in step_events)
    assert "power/trace" in acc.Tags()["images"]
    assert acc.Tags()["tensors"], "custom scalars layout missing"
    layout = acc.Tensors("custom_scalars__config__")[0]
    assert b"energy/step_J" in layout.tensor_proto.string_val[0]
    assert b"energy/epoch_J" in layout.tensor_proto.string_val[0]
    assert b"train/loss" in layout.tensor_proto.string_val[0]
    # step level, epoch ends and fit end, one process; epoch figures arrive a few steps after their end, so
    # TensorBoard's step axis, not the order of writing, is what must rise
    totals = [e.value for e in sorted(acc.Scalars("energy/total_J"), key=lambda e: (e.step, e.wall_time))]
    assert len(totals) == STEPS // 2 + EPOCHS + 1 and totals == sorted(totals)
    assert "energy/rank0_total_J" not in tags  # the rank-local figure is for DDP only


def test_report_figures_are_exact_for_constant_power(tmp_path, capsys):
    callback = EnergyCallback(sensors=simulated_sensors())
    logger = RecordingLogger(tmp_path)
    trainer = fit(tmp_path, callback, logger)
    report = json.loads((callback.report_path).read_text())
    assert callback.report_path.parent == tmp_path
    assert report == json.loads(json.dumps(callback.report))
    epochs = report["epochs"]
    assert len(epochs) == EPOCHS
    for row in epochs:
        assert row["train_J"] == pytest.approx((DEVICE_W + HOST_W) * row["train_s"], rel=1e-9)
        assert row["power_W"] == pytest.approx(DEVICE_W + HOST_W, rel=1e-9)
        assert row["per_sensor_J"]["device"] == pytest.approx(DEVICE_W * row["train_s"], rel=1e-9)
        assert row["steps"] == 10
        assert 0 < row["steps_J"] < row["train_J"]
        assert row["steps_J"] + row["between_steps_J"] == pytest.approx(row["train_J"], rel=1e-12)
        assert row["validation_J"] > 0  # validation measured, and not inside train_J
    sensors = {s["name"]: s for s in report["sensors"]}
    assert sensors["device"]["energy_J"] == pytest.approx(DEVICE_W * report["duration_s"], rel=1e-9)
    assert sensors["host"]["mean_power_W"] == pytest.approx(HOST_W, rel=1e-9)
    assert report["total_J"] == pytest.approx((DEVICE_W + HOST_W) * report["duration_s"], rel=1e-9)
    assert report["train_J"] == pytest.approx(sum(r["train_J"] for r in epochs), rel=1e-12)
    assert report["train_J"] + report["validation_J"] < report["total_J"]
    assert report["estimated"] is False and report["estimated_J"] == 0 and report["provenance"] == "simulated"
    assert logger.values("energy/epoch_J") == pytest.approx([e["train_J"] for e in epochs], rel=1e-12)
    assert logger.values("edp/epoch_Js") == pytest.approx([e["train_J"] * e["train_s"] for e in epochs], rel=1e-12)
    printed = capsys.readouterr().out
    assert "lightning-energy report" in printed and "device" in printed and "simulated" in printed


class SlowValidation(TinyRegressor):
    """Validation steps of VALIDATION_STEP_S each: validation clearly outweighs the few training steps."""

    def validation_step(self, batch, batch_idx):
        time.sleep(VALIDATION_STEP_S)
        return super().validation_step(batch, batch_idx)


def test_validation_is_measured_apart_from_training(tmp_path):
    callback = EnergyCallback(sensors=simulated_sensors(), verbose=False)
    logger = RecordingLogger(tmp_path)
    trainer = L.Trainer(callbacks=[callback], logger=logger,
                        **trainer_kwargs(tmp_path, max_epochs=1, num_sanity_val_steps=0))
    trainer.fit(SlowValidation(), tiny_loader(), tiny_loader(n=48))
    row = callback.report["epochs"][0]
    (val_J,) = logger.values("energy/val_epoch_J")
    (val_s,) = logger.values("time/val_epoch_s")
    assert val_s >= 3 * VALIDATION_STEP_S  # three validation batches
    assert val_J == pytest.approx((DEVICE_W + HOST_W) * val_s, rel=1e-5)
    assert row["validation_J"] == pytest.approx(val_J, rel=1e-5)
    # the training epoch excludes validation: training + validation time = the epoch's wall window
    with open(tmp_path / "energy_events.csv", newline="") as fh:
        events = {r["event"]: float(r["time_s"]) for r in csv.DictReader(fh)}
    assert row["train_s"] + val_s == pytest.approx(events["epoch_end"] - events["epoch_start"], abs=1e-5)
    # (not `train_s < val_s`: on a loaded machine ten bare training steps can outlast the sleeping validation)
    assert row["train_J"] == pytest.approx((DEVICE_W + HOST_W) * row["train_s"], rel=1e-5)


def test_csv_logger_gets_the_metrics(tmp_path):
    callback = EnergyCallback(sensors=simulated_sensors(), verbose=False, log_power_figure=False)
    trainer = fit(tmp_path, callback, CSVLogger(str(tmp_path), name="csv"))
    with open(f"{trainer.log_dir}/metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    columns = set(rows[0])
    assert set(PUBLIC_METRICS) <= columns
    assert sum(1 for r in rows if r["energy/step_J"]) == STEPS // 2  # log_every_n_steps=2


def test_trace_files_hold_samples_and_events(tmp_path):
    callback = EnergyCallback(sensors=simulated_sensors(), verbose=False, interval_s=0.005)
    trainer = fit(tmp_path, callback)
    columns = read_trace(callback.trace_path)
    assert {"time_s", "unix_time_s", "device:energy_J", "device:power_W", "host:power_W"} <= set(columns)
    assert len(columns["time_s"]) >= 3
    assert all(p == pytest.approx(DEVICE_W) for p in columns["device:power_W"][1:])
    assert columns["time_s"] == sorted(columns["time_s"])
    with open(callback.trace_path.parent / "energy_events.csv", newline="") as fh:
        events = [r["event"] for r in csv.DictReader(fh)]
    for name in ("fit_start", "train_start", "epoch_start", "epoch_end", "validation_start", "train_end", "fit_end"):
        assert name in events, name
    assert events[0] == "fit_start" and events[-1] == "fit_end"
    assert not list(tmp_path.rglob("*.partial"))


def test_zero_configuration_on_a_cpu_only_machine_is_a_labelled_estimate(tmp_path, monkeypatch):
    empty_powercap = tmp_path / "powercap"  # hermetic: no RAPL zones, whatever this machine has
    empty_powercap.mkdir()
    monkeypatch.setattr("lightning_energy.measure.sensors.rapl.POWERCAP_ROOT", empty_powercap)
    callback = EnergyCallback(verbose=False)
    fit(tmp_path, callback, max_epochs=1)
    report = callback.report
    assert report["estimated"] is True
    (sensor,) = report["sensors"]
    assert sensor["name"] == "cpu_estimate" and sensor["estimated"] is True
    assert sensor["assumed_tdp_W"] > 0 and "ESTIMATE" in sensor["source"]
    assert report["estimated_J"] == pytest.approx(report["total_J"]) and report["total_J"] > 0


class SlowSteps(TinyRegressor):
    """Training steps of at least 20 ms, so that a run lasts a known minimum time."""

    def training_step(self, batch, batch_idx):
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)


FAIL_AFTER_S = 0.25  # the device sensor's failure, s after it is opened; epochs of >= 0.2 s, so epoch 2 is after it


def test_a_failing_sensor_keeps_its_energy_until_the_failure_and_training_goes_on(tmp_path):
    device = SimulatedSensor("device", DEVICE_W, fail_after_s=FAIL_AFTER_S)
    callback = EnergyCallback(sensors=[device, SimulatedSensor("host", HOST_W, scope="host")], verbose=False,
                              interval_s=0.01)
    logger = RecordingLogger(tmp_path)
    trainer = L.Trainer(callbacks=[callback], logger=logger, **trainer_kwargs(tmp_path, max_epochs=3))
    with pytest.warns(UserWarning, match="rank 0: sensor 'device' failed") as record:
        trainer.fit(SlowSteps(), tiny_loader(), tiny_loader(n=48))
    assert sum("sensor 'device' failed" in str(w.message) for w in record) == 1  # once, not per step
    assert trainer.current_epoch == 3  # training finished
    report = callback.report
    by_name = {s["name"]: s for s in report["sensors"]}
    assert "simulated failure" in by_name["device"]["failure"]
    assert by_name["host"]["failure"] is None and by_name["host"]["missing_from_s"] is None
    assert by_name["host"]["energy_J"] == pytest.approx(HOST_W * report["duration_s"], rel=1e-9)
    # the device's energy up to its last good sample is kept: the exact integral of its trace up to then
    missing_from_s = by_name["device"]["missing_from_s"]
    last_good = callback.fit_start_s + missing_from_s - device._origin  # s after the sensor was opened
    assert FAIL_AFTER_S - 0.2 < last_good <= FAIL_AFTER_S
    assert by_name["device"]["energy_J"] == pytest.approx(DEVICE_W * missing_from_s, rel=1e-9)
    assert by_name["device"]["energy_J"] == pytest.approx(
        device.energy_at(last_good) - device.energy_at(callback.fit_start_s - device._origin), rel=1e-9)
    assert report["total_J"] == pytest.approx(by_name["host"]["energy_J"] + by_name["device"]["energy_J"], rel=1e-12)
    # the epochs after the failure are flagged and get no device energy
    last = report["epochs"][-1]
    assert last["missing_sensors"] == [{"sensor": "device", "rank": 0}] and "device" not in last["per_sensor_J"]
    assert "missing from" in format_report(report) and "lack some sensors" in format_report(report)
    # the running total never goes down, step level and epoch level alike
    totals = logger.values("energy/total_J")
    assert len(totals) == 15 + 3 + 1 and totals == sorted(totals)
    assert totals[-2] == pytest.approx(last["total_J"], rel=1e-12) and totals[-1] == report["total_J"]  # fit end


def test_a_failure_on_a_rank_other_than_zero_is_warned_there(tmp_path, monkeypatch):
    """Ranks != 0 must warn too: rank_zero_warn would stay silent there."""
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    sensors = [SimulatedSensor("device", DEVICE_W, fail_after_s=0.0), SimulatedSensor("host", HOST_W, scope="host")]
    callback = EnergyCallback(sensors=sensors, verbose=False, write_trace=False)
    trainer = L.Trainer(callbacks=[callback], logger=False, **trainer_kwargs(tmp_path))
    monkeypatch.setattr(SingleDeviceStrategy, "global_rank", property(lambda self: 1), raising=False)
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    with pytest.warns(UserWarning, match="rank 1: sensor 'device' failed") as record:
        trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    assert sum("sensor 'device' failed" in str(w.message) for w in record) == 1
    assert trainer.current_epoch == EPOCHS  # training finished


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_resume_continues_the_cumulative_energy(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    first = EnergyCallback(sensors=simulated_sensors(), verbose=False)
    trainer = L.Trainer(callbacks=[first, ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], logger=RecordingLogger(tmp_path),
                        **trainer_kwargs(tmp_path, max_epochs=2, enable_checkpointing=True))
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    state = energy_state(ckpt_dir / "last.ckpt")
    assert len(state["epochs"]) == 2
    assert state["total_J"] == pytest.approx((DEVICE_W + HOST_W) * state["duration_s"], rel=1e-9)  # at save time
    assert first.report["epochs"][-1]["total_J"] <= state["total_J"] <= first.report["total_J"]

    second = EnergyCallback(sensors=simulated_sensors(), verbose=False)
    logger = RecordingLogger(tmp_path)
    trainer = L.Trainer(callbacks=[second, ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], logger=logger,
                        **trainer_kwargs(tmp_path, max_epochs=4, enable_checkpointing=True))
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48), ckpt_path=ckpt_dir / "last.ckpt")
    report = second.report
    assert [e["epoch"] for e in report["epochs"]] == [0, 1, 2, 3]
    assert report["resumed"]["total_J"] == pytest.approx(state["total_J"])
    session_J = sum(s["energy_J"] for s in report["sensors"])
    assert report["total_J"] == pytest.approx(state["total_J"] + session_J, rel=1e-12)
    assert report["epochs"][2]["total_J"] > state["total_J"]
    assert logger.values("energy/total_J")[-2] == pytest.approx(report["epochs"][-1]["total_J"], rel=1e-12)
    assert logger.values("energy/total_J")[-1] == report["total_J"]  # logged at the end of fit


def energy_state(path) -> dict:
    import torch

    saved = torch.load(path, weights_only=False)
    return next(v for k, v in saved["callbacks"].items() if k.startswith("EnergyCallback"))


@pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended before the epoch ended")
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_resume_from_a_mid_epoch_checkpoint_keeps_the_energy_of_the_open_epoch(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    power_W = DEVICE_W + HOST_W
    first = EnergyCallback(sensors=simulated_sensors(), verbose=False)
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=15, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(callbacks=[first, checkpoint],
                        **trainer_kwargs(tmp_path, max_epochs=2, enable_checkpointing=True))
    trainer.fit(SlowSteps(), tiny_loader(n=160), tiny_loader(n=48))
    state = energy_state(ckpt_dir / "step=15.ckpt")  # 5 steps into the second epoch
    assert len(state["epochs"]) == 1 and state["open_epoch"] == 1
    assert state["duration_s"] > first.report["epochs"][0]["train_s"] + 5 * 0.02
    assert state["total_J"] == pytest.approx(power_W * state["duration_s"], rel=1e-9)
    assert state["total_J"] > first.report["epochs"][0]["total_J"] + power_W * 5 * 0.02  # the open epoch's steps
    assert state["train_J"] + state["validation_J"] < state["total_J"]

    second = EnergyCallback(sensors=simulated_sensors(), verbose=False)
    logger = RecordingLogger(tmp_path)
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=15, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(callbacks=[second, checkpoint], logger=logger,
                        **trainer_kwargs(tmp_path, max_epochs=3, enable_checkpointing=True))
    trainer.fit(SlowSteps(), tiny_loader(n=160), tiny_loader(n=48), ckpt_path=ckpt_dir / "step=15.ckpt")
    report = second.report
    assert report["resumed"]["total_J"] == state["total_J"]
    assert report["total_J"] == pytest.approx(state["total_J"] + power_W * (report["duration_s"] - state["duration_s"]),
                                              rel=1e-9)
    assert [e["epoch"] for e in report["epochs"]] == [0, 1, 2]
    assert report["epochs"][1].get("resumed_mid_epoch") is True and "resumed_mid_epoch" not in report["epochs"][2]
    totals = logger.values("energy/total_J")
    assert totals == sorted(totals) and totals[0] > state["total_J"]
    # the total continues from the saved value: saved + constant power x time since the new fit started
    since_resume_s = second.last_epoch_end_s - second.fit_start_s
    assert report["epochs"][-1]["total_J"] == pytest.approx(state["total_J"] + power_W * since_resume_s, rel=1e-9)
    assert totals[-2] == pytest.approx(report["epochs"][-1]["total_J"], rel=1e-6) and totals[-1] == report["total_J"]


def test_zeus_epoch_window_leaves_validation_out_like_ours(tmp_path, monkeypatch):
    """The Zeus cross-check covers the same interval as energy/epoch_J, even with long validation.

    Fake time (``install_fake_time``): steps of 10 ms, validation batches of VALIDATION_STEP_S, and Zeus's
    windows read the same clock, so both figures are exact. (In real time the edges of the two windows lie
    a scheduling delay apart and a loaded machine stretches the ten bare training steps past the sleeping
    validation; neither is what this test is about.)
    """
    import types

    from lightning_energy.measure.sensors.zeus import ZeusBackend
    from power_limit_helpers import install_fake_time

    clock = install_fake_time(monkeypatch.setattr)
    step_s = 0.01

    class FakeMonitor:
        """ZeusMonitor's window API, measuring the same constant power on the same clock."""

        def __init__(self):
            self.windows: list[tuple[float, float]] = []
            self._begin = None

        def begin_window(self, name, sync_execution=True, restart=False):
            self._begin = clock()

        def end_window(self, name, sync_execution=True):
            self.windows.append((self._begin, clock()))
            joules = (DEVICE_W + HOST_W) * (self.windows[-1][1] - self.windows[-1][0])
            return types.SimpleNamespace(gpu_energy={0: joules}, cpu_energy=None, dram_energy=None)

    monitor = FakeMonitor()
    sensors = [SimulatedSensor("device", DEVICE_W, kind="energy", clock=clock),
               SimulatedSensor("host", HOST_W, scope="host", kind="energy", clock=clock)]
    monkeypatch.setattr("lightning_energy.core.run.zeus_sensors",
                        lambda cuda_index, read_host: (sensors, ZeusBackend(None, False, monitor=monitor)))

    callback = EnergyCallback(backend="zeus", verbose=False)
    logger = RecordingLogger(tmp_path)
    trainer = L.Trainer(callbacks=[callback], logger=logger, **trainer_kwargs(tmp_path, num_sanity_val_steps=0))
    trainer.fit(FakeTimeSteps(clock, step_s, VALIDATION_STEP_S), tiny_loader(), tiny_loader(n=48))
    assert len(monitor.windows) == 2 * EPOCHS  # per epoch: the training steps, then the bit after validation
    zeus, ours = logger.values("energy/zeus_epoch_J"), logger.values("energy/epoch_J")
    val = logger.values("energy/val_epoch_J")
    assert len(zeus) == len(ours) == EPOCHS
    for z, o, v in zip(zeus, ours, val):
        assert o == pytest.approx((DEVICE_W + HOST_W) * 10 * step_s, rel=1e-9)  # ten steps, nothing else
        assert v == pytest.approx((DEVICE_W + HOST_W) * 3 * VALIDATION_STEP_S, rel=1e-9)  # 3 x training
        assert z == pytest.approx(o, rel=1e-9)  # the same interval: validation left out
    assert [row["zeus_J"] for row in callback.report["epochs"]] == pytest.approx(zeus, rel=1e-6)


@pytest.mark.parametrize("loop", ["test", "validate"])
def test_test_and_validate_loops_are_measured(tmp_path, loop):
    callback = EnergyCallback(sensors=simulated_sensors(), verbose=False)
    logger = RecordingLogger(tmp_path)
    trainer = L.Trainer(callbacks=[callback], logger=logger, **trainer_kwargs(tmp_path))
    (results,) = getattr(trainer, loop)(TinyRegressor(), tiny_loader(n=48))
    prefix = "test" if loop == "test" else "val"
    (seconds,) = logger.values(f"time/{prefix}_epoch_s")
    assert seconds > 0
    assert logger.values(f"energy/{prefix}_epoch_J") == pytest.approx([(DEVICE_W + HOST_W) * seconds], rel=1e-9)
    # figures go to the loggers, not into Lightning's result table (nor the dicts it returns)
    assert not [k for k in results if k.startswith(("energy/", "time/", "power/"))]
    assert callback.report is None  # the end-of-fit report belongs to fits


def test_one_sampling_thread_for_several_callbacks(tmp_path):
    seen = []

    class CountThreads(L.Callback):
        def on_train_batch_end(self, *args):
            seen.append(sum(t.name == "lightning-energy-sampler" for t in threading.enumerate()))

    callbacks = [EnergyCallback(sensors=simulated_sensors(), verbose=False, write_trace=False),
                 EnergyCallback(sensors=[SimulatedSensor("other", 5.0)], verbose=False, write_trace=False),
                 CountThreads()]
    trainer = L.Trainer(callbacks=callbacks, logger=False, **{k: v for k, v in trainer_kwargs(tmp_path).items()})
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    assert seen and set(seen) == {1}
    assert not any(t.name == "lightning-energy-sampler" for t in threading.enumerate())


def test_training_exception_releases_the_sampler(tmp_path):
    callback = EnergyCallback(sensors=simulated_sensors(), verbose=False)
    trainer = L.Trainer(callbacks=[callback], **trainer_kwargs(tmp_path))
    with pytest.raises(RuntimeError, match="injected"):
        trainer.fit(TinyRegressor(fail_at_step=3), tiny_loader(), tiny_loader(n=48))
    assert not any(t.name == "lightning-energy-sampler" for t in threading.enumerate())
    assert callback.trace_path.exists() and not list(tmp_path.rglob("*.partial"))


def test_any_lightning_logger_receives_the_metrics(tmp_path):
    logger = RecordingLogger(tmp_path)
    callback = EnergyCallback(sensors=simulated_sensors(), verbose=False)
    trainer = fit(tmp_path, callback, logger)
    keys = {k for _, metrics in logger.metrics for k in metrics}
    assert set(PUBLIC_METRICS) <= keys
    steps = [step for step, metrics in logger.metrics if "energy/step_J" in metrics]
    assert steps == sorted(steps) and len(steps) == STEPS // 2  # log_every_n_steps=2
    assert "energy_kJ" in trainer.progress_bar_metrics
    assert trainer.progress_bar_metrics["energy_kJ"] > 0


def test_lightning_cli_config_with_simulated_sensors(tmp_path, monkeypatch):
    from pathlib import Path

    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    config = Path(__file__).resolve().parents[1] / "configs" / "energy_simulated.yaml"
    monkeypatch.setattr("sys.argv", ["lightning-cli"])
    cli = LightningCLI(
        BoringModel, BoringDataModule, run=False, save_config_kwargs={"overwrite": True},
        args=["--config", str(config), "--seed_everything=1", "--trainer.max_epochs=1", "--trainer.limit_train_batches=4",
              "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false",
              "--trainer.log_every_n_steps=1", f"--trainer.default_root_dir={tmp_path}"],
    )
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, EnergyCallback)]
    cli.trainer.fit(cli.model, cli.datamodule)
    names = {s["name"]: s for s in callback.report["sensors"]}
    assert set(names) == {"sim_gpu", "sim_cpu"}
    assert names["sim_cpu"]["mean_power_W"] == pytest.approx(45.0, rel=1e-9)
