"""Figures right in combination: each callback's figures cover exactly its own sensors, one callback object in a
second Trainer starts afresh, and every figure is logged at the step Lightning uses for the same boundary.

Fake time throughout (``install_fake_time``): a sample after every step, so every window is exact and any
difference from the sensors' constant powers is a bookkeeping error, not a measurement one.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from conftest import RecordingLogger
from power_limit_helpers import SimModule, install_fake_time, loader
from lightning_energy import CarbonCallback, EnergyCallback, SimulatedSensor

STEP_S = 0.1


class TimedModule(SimModule):
    """Each training step takes STEP_S fake seconds; logs ``train/loss`` per step and per epoch."""

    def training_step(self, batch, batch_idx):
        self.clock.advance(STEP_S)
        (x,) = batch
        loss = self.layer(x).square().mean()
        self.log("train/loss", loss, on_step=True, on_epoch=True)
        return loss


class TwoOptimizerModule(L.LightningModule):
    """Manual optimisation with two optimizers: ``trainer.global_step`` counts both."""

    def __init__(self, clock) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b, self.clock = nn.Linear(4, 1), nn.Linear(4, 1), clock

    def training_step(self, batch, batch_idx):
        self.clock.advance(STEP_S)
        (x,) = batch
        for layer, opt in zip((self.a, self.b), self.optimizers()):
            loss = layer(x).square().mean()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        self.log("train/loss", loss, on_step=True, on_epoch=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.01), torch.optim.SGD(self.b.parameters(), lr=0.01)


def fake_sensor(name: str, watts: float, clock) -> SimulatedSensor:
    return SimulatedSensor(name, watts, clock=clock)


def fit(tmp_path, clock, callbacks, module=None, batches: int = 8, epochs: int = 2, **kwargs):
    logger = RecordingLogger(tmp_path)
    trainer = L.Trainer(callbacks=callbacks, logger=logger, max_epochs=epochs, log_every_n_steps=1,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        accelerator="cpu", devices=1, default_root_dir=str(tmp_path), **kwargs)
    trainer.fit(module if module is not None else TimedModule(clock=clock), loader(batches, batch_size=4))
    return trainer, logger


@pytest.mark.parametrize("carbon_first", [False, True])
def test_energy_callback_beside_a_carbon_callback_with_other_sensors_reports_only_its_own(
        tmp_path, monkeypatch, carbon_first):
    clock = install_fake_time(monkeypatch.setattr)
    energy = EnergyCallback(sensors=[fake_sensor("fifty", 50.0, clock)], verbose=False, write_trace=False,
                            log_power_figure=False)
    carbon = CarbonCallback(intensity_g_per_kWh=100.0, sensors=[fake_sensor("thirty", 30.0, clock)], verbose=False)
    _, logger = fit(tmp_path, clock, [carbon, energy] if carbon_first else [energy, carbon])

    for key in ("power/epoch_W", "power/step_W"):
        assert logger.values(key) and all(v == pytest.approx(50.0, rel=1e-9) for v in logger.values(key)), key
    report = energy.report
    assert report["train_J"] == pytest.approx(sum(r["train_J"] for r in report["epochs"]), rel=1e-9)
    assert all(r["power_W"] == pytest.approx(50.0, rel=1e-9) for r in report["epochs"])
    assert all(set(r["per_sensor_J"]) == {"fifty"} for r in report["epochs"])
    assert report["total_J"] == pytest.approx(50.0 * report["duration_s"], rel=1e-9)
    assert report["figures_cover"] == ["fifty"]  # the report says which sensors its figures cover
    totals = logger.values("energy/total_J")
    assert totals == sorted(totals)  # a running total never goes down
    # and the carbon callback's energy is its own sensor's
    assert carbon.report["total_J"] == pytest.approx(30.0 * report["duration_s"], rel=1e-9)


def test_one_callback_object_in_a_second_trainer_starts_afresh(tmp_path, monkeypatch):
    clock = install_fake_time(monkeypatch.setattr)
    energy = EnergyCallback(sensors=[fake_sensor("fifty", 50.0, clock)], verbose=False, write_trace=False,
                            log_power_figure=False)
    fit(tmp_path / "one", clock, [energy])
    first = energy.report["total_J"]
    fit(tmp_path / "two", clock, [energy], batches=4, epochs=1)
    second = energy.report
    assert second["total_J"] == pytest.approx(50.0 * second["duration_s"], rel=1e-9)
    assert second["total_J"] < first


def test_a_second_fit_on_one_trainer_continues_the_first(tmp_path, monkeypatch):
    clock = install_fake_time(monkeypatch.setattr)
    energy = EnergyCallback(sensors=[fake_sensor("fifty", 50.0, clock)], verbose=False, write_trace=False,
                            log_power_figure=False)
    trainer, _ = fit(tmp_path, clock, [energy], epochs=1)
    first = energy.report["total_J"]
    trainer.fit_loop.max_epochs = 2
    trainer.fit(TimedModule(clock=clock), loader(8, batch_size=4))
    report = energy.report
    assert report["resumed"]["total_J"] == pytest.approx(first, rel=1e-12)
    assert report["total_J"] == pytest.approx(50.0 * report["duration_s"], rel=1e-9)  # both fits' time
    assert report["total_J"] > first


def test_epoch_figures_are_logged_at_the_step_of_lightnings_own_epoch_metrics(tmp_path, monkeypatch):
    clock = install_fake_time(monkeypatch.setattr)
    energy = EnergyCallback(sensors=[fake_sensor("fifty", 50.0, clock)], verbose=False, write_trace=False,
                            log_power_figure=False)
    _, logger = fit(tmp_path, clock, [energy])
    lightning_epoch_steps = logger.steps("train/loss_epoch")
    assert lightning_epoch_steps == [7, 15]
    assert logger.steps("energy/epoch_J") == lightning_epoch_steps
    assert logger.steps("energy/total_J")[-1] == lightning_epoch_steps[-1]


def test_with_two_optimizers_every_figure_uses_lightnings_logging_step(tmp_path, monkeypatch):
    clock = install_fake_time(monkeypatch.setattr)
    energy = EnergyCallback(sensors=[fake_sensor("fifty", 50.0, clock)], verbose=False, write_trace=False,
                            log_power_figure=False)
    trainer, logger = fit(tmp_path, clock, [energy], module=TwoOptimizerModule(clock))
    assert trainer.global_step == 32  # two optimizer steps per batch
    last_lightning_step = max(logger.steps("train/loss_step") + logger.steps("train/loss_epoch"))
    assert last_lightning_step == 15
    assert max(logger.steps("energy/total_J")) == last_lightning_step
    assert logger.steps("energy/epoch_J") == logger.steps("train/loss_epoch")


def test_every_suite_callback_attached_leaves_the_energy_callbacks_figures_its_own(tmp_path, monkeypatch):
    """The power-limit optimiser's simulated GPU and a carbon callback's sensor join the session: the
    EnergyCallback given one 50 W sensor still logs and reports 50 W, and its running total never drops."""
    from lightning_energy import CatalogCallback, ForecastCallback
    from lightning_energy.callbacks.power_limit import PowerLimitOptimizer
    from lightning_energy.simulate.gpu_sim import SimulatedGPU, SimulatedWorkload

    clock = install_fake_time(monkeypatch.setattr)
    gpu = SimulatedGPU(clock=clock)
    energy = EnergyCallback(sensors=[fake_sensor("fifty", 50.0, clock)], verbose=False, write_trace=False,
                            log_power_figure=False)
    others = [PowerLimitOptimizer(selector="zeus_cost", wait_steps=1, warmup_steps=1, profile_steps=3, gpu=gpu,
                                  log_figure=False),
              CarbonCallback(intensity_g_per_kWh=100.0, sensors=[fake_sensor("thirty", 30.0, clock)], verbose=False),
              CatalogCallback(tmp_path / "catalog.sqlite"), ForecastCallback(verbose=False)]
    _, logger = fit(tmp_path, clock, [SimulatedWorkload(gpu=gpu), *others, energy], module=SimModule(), batches=20)
    for key in ("power/epoch_W", "power/step_W"):
        assert logger.values(key) and all(v == pytest.approx(50.0, rel=1e-9) for v in logger.values(key)), key
    totals = logger.values("energy/total_J")
    assert totals == sorted(totals)
    report = energy.report
    assert report["total_J"] == pytest.approx(50.0 * report["duration_s"], rel=1e-9)
    assert report["train_J"] <= report["total_J"] * (1 + 1e-12)
    assert all(r["power_W"] == pytest.approx(50.0, rel=1e-9) for r in report["epochs"])


def test_two_ranks_reading_one_card_count_it_once_in_the_report():
    """MPS or a mis-set CUDA_VISIBLE_DEVICES: two ranks' NVML sensors read one card (one UUID)."""
    from lightning_energy.outputs.report import build_report

    def summary(rank: int, uuid: str) -> dict:
        sensor = {"name": "gpu0", "scope": "device", "estimated": False, "provenance": "measured", "source": "NVML",
                  "device_uuid": uuid, "rank": rank, "energy_J": 100.0}
        host = {"name": "cpu", "scope": "host", "estimated": False, "provenance": "measured", "source": "RAPL",
                "rank": rank, "energy_J": 10.0}
        return {"rank": rank, "duration_s": 1.0, "train_J": 150.0, "validation_J": 0.0,
                "sensors": [sensor, host] if rank == 0 else [sensor]}

    shared = build_report([summary(0, "GPU-aaaa"), summary(1, "GPU-AAAA")], [], {})
    assert shared["total_J"] == pytest.approx(110.0)
    assert [s.get("counted", True) for s in shared["sensors"]] == [True, True, False]
    separate = build_report([summary(0, "GPU-aaaa"), summary(1, "GPU-bbbb")], [], {})
    assert separate["total_J"] == pytest.approx(210.0)
    assert shared["train_J"] == separate["train_J"] == 150.0  # all-rank already: not once per rank


def stub_trainer(parameter_devices: list[str]):
    """Enough of a Trainer for a session on a CUDA root: a module whose parameters sit on these devices."""
    import types

    def on(device: str):
        return types.SimpleNamespace(device=torch.device(device))

    module = types.SimpleNamespace(parameters=lambda: iter([on(d) for d in parameter_devices]), buffers=lambda: iter([]))
    return types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cuda", 0)),
                                 lightning_module=module, world_size=1, global_rank=0, local_rank=0, current_epoch=0,
                                 fit_loop=types.SimpleNamespace(restarted_mid_epoch=False))


def test_a_model_on_devices_besides_the_root_has_them_measured_from_train_start(monkeypatch, recwarn):
    """Several GPUs in one process (a pipeline over cuda:0 and cuda:1): at train start (once, whoever reports
    first) cuda:1's card joins the auto-detected sensors, the fit's start counts as its first reading, and
    one warning and a note in every callback's report say so; a callback given its own sensors is only told."""
    import sys

    from fakes_nvml import FakeClock, FakeNvml, h100s
    from power_limit_helpers import FakeHostClock, ThreadlessSampler
    from lightning_energy.integration.session import Attachment, TrainerSession

    clock = FakeClock()
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(h100s(2), clock))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    trainer = stub_trainer(["cuda:0", "cuda:1"])
    sampler = ThreadlessSampler(clock=clock)
    session = TrainerSession(trainer, sampler, FakeHostClock(clock))
    auto, given = object(), object()
    session.add(auto_attachment := Attachment(session, auto, [], auto=True), 0.05)
    session.add(given_attachment := Attachment(session, given, [SimulatedSensor("mine", 10.0, clock=clock)]), 0.05)
    session.timeline.fit_started(trainer)
    clock.advance(0.1)
    sampler.sample_once()
    assert session.timeline.fit_start.resolved
    for _ in range(3):  # three callbacks report the boundary
        session.timeline.train_started(trainer)
    assert [s.name for s in auto_attachment.sensors] == ["gpu1"] and "gpu1" in session.meter.sensor_names
    assert given_attachment.sensor_names == ["mine"]
    assert "gpu1" in session.timeline.fit_start.energy  # counted from its first reading
    warned = [str(w.message) for w in recwarn if "cuda:1" in str(w.message)]
    assert len(warned) == 1 and "measured from train start" in warned[0]
    assert auto_attachment.notes == given_attachment.notes == [warned[0].removeprefix("lightning-energy: ")]
    session.remove(given)
    assert session.remove(auto)  # the last one closes the session, and the added sensor with it
    assert "gpu1" not in sampler.series


def test_a_model_on_devices_besides_the_root_is_only_told_to_callbacks_given_their_sensors(recwarn):
    from lightning_energy.integration.session import Attachment, TrainerSession
    from lightning_energy.measure.sampler import Sampler

    trainer = stub_trainer(["cuda:0", "cuda:1"])
    session = TrainerSession(trainer, Sampler(), None)
    owner = object()
    attachment = session.attachments[id(owner)] = Attachment(session, owner, [])
    session.timeline.train_started(trainer)
    warned = [str(w.message) for w in recwarn if "cuda:1" in str(w.message)]
    assert len(warned) == 1 and "Give their sensors explicitly" in warned[0]
    assert len(attachment.notes) == 1 and "cuda:1" in attachment.notes[0]


def test_the_report_says_how_a_gpu_counter_was_attributed(tmp_path, monkeypatch):
    """A fake H100's counter and instant power through a fit: the report names the rule its figures used."""
    from fakes_nvml import FakeNvml, h100s
    from lightning_energy.measure.sensors.nvml import NvmlGpuSensor

    clock = install_fake_time(monkeypatch.setattr)
    fake = FakeNvml(h100s(1, power_W=120.0), clock)
    energy = EnergyCallback(sensors=[NvmlGpuSensor(0, pynvml_module=fake)], verbose=False, write_trace=False,
                            log_power_figure=False)
    fit(tmp_path, clock, [energy], batches=4, epochs=1)
    (sensor,) = energy.report["sensors"]
    assert sensor["attribution"].startswith(("shaped by", "plain counter rule"))


def test_an_error_the_sampling_survives_is_warned_about_and_counted_in_the_report(tmp_path, monkeypatch):
    """Not a sensor's: a listener (or a meter's clock) raising on the sampling thread."""
    clock = install_fake_time(monkeypatch.setattr)
    energy = EnergyCallback(sensors=[fake_sensor("fifty", 50.0, clock)], verbose=False, write_trace=False,
                            log_power_figure=False)

    class BrokenListener(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            def broken(t, readings):
                raise RuntimeError("injected listener failure")
            energy.attachment.sampler.add_listener(broken)

    with pytest.warns(UserWarning, match="injected listener failure"):
        fit(tmp_path, clock, [energy, BrokenListener()], batches=4, epochs=1)
    errors = energy.report["sampling"]["errors"]
    assert sum(errors.values()) == 1 and "listener" in next(iter(errors))
    assert energy.report["total_J"] == pytest.approx(50.0 * energy.report["duration_s"], rel=1e-9)


def test_a_checkpoint_at_an_epoch_end_holds_only_the_callbacks_own_sensors(tmp_path, monkeypatch):
    """ModelCheckpoint saves at the epoch's end, before the epoch is delivered: its row is estimated from the
    samples at hand (provisional), and covers the EnergyCallback's sensors alone, as the delivered row will."""
    clock = install_fake_time(monkeypatch.setattr)
    energy = EnergyCallback(sensors=[fake_sensor("fifty", 50.0, clock)], verbose=False, write_trace=False,
                            log_power_figure=False)
    carbon = CarbonCallback(intensity_g_per_kWh=100.0, sensors=[fake_sensor("thirty", 30.0, clock)], verbose=False)
    saved = []

    class SaveAtEpochEnd(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            saved.append(energy.state_dict())

    fit(tmp_path, clock, [energy, carbon, SaveAtEpochEnd()], epochs=1)
    (state,) = saved
    (row,) = state["epochs"]
    assert row.get("provisional") and set(row["per_sensor_J"]) == {"fifty"}
    assert row["power_W"] == pytest.approx(50.0, rel=1e-9)


def test_a_sensor_whose_description_raises_still_takes_part_in_the_card_count():
    """Under DDP every rank gathers its sensors' descriptions once: one that raises must not keep a rank from
    the collective (the others would wait for ever)."""
    from lightning_energy.measure.sensors.base import described as _description  # the one the timeline uses

    class Broken(SimulatedSensor):
        def describe(self):
            raise RuntimeError("a user's sensor")

    assert _description(Broken("mine", 10.0)) == {"name": "mine"}
    assert _description(SimulatedSensor("fine", 10.0))["name"] == "fine"
