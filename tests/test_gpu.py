"""On a CUDA GPU: our per-epoch energy against a direct NVML counter delta and against Zeus.

Read-only NVML queries only (never clocks or power limits). Skipped without CUDA.
"""

from __future__ import annotations

import math
import statistics
import time

import lightning as L
import pytest
import torch
from torch import nn

from conftest import trainer_kwargs
from lightning_energy import EnergyCallback

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


COUNTER_PERIOD_S = 0.1  # NVML's total-energy counter advances every 100 ms (measured: benchmarks/nvml_semantics.py)
EPOCH_STEPS = 40
EPOCH_S = 5.0  # GPU time per epoch: 50 counter periods, whatever the card


class MatmulModel(L.LightningModule):
    """Two 4096-wide layers on 64 rows, run ``repeats`` times a step: milliseconds of GPU work per chain."""

    def __init__(self, repeats: int = 1):
        super().__init__()
        self.repeats = repeats
        self.net = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = sum(self.net(x).square().mean() for _ in range(self.repeats)) / self.repeats
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def repeats_for(step_s: float) -> int:
    """Chains per step for about ``step_s`` of GPU time a step on this card (timed with CUDA events): a fixed
    workload lasts ~1 s an epoch on a slow card and less than one counter period on an H200."""
    model = MatmulModel().cuda()
    x = torch.randn(64, 4096, device="cuda")
    for _ in range(3):
        model.net(x).square().mean().backward()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        model.net(x).square().mean().backward()
    end.record()
    end.synchronize()
    chain_s = start.elapsed_time(end) / 1000 / 10
    return max(1, math.ceil(step_s / chain_s))


def loader(steps: int = EPOCH_STEPS):
    x = torch.randn(64 * steps, 4096)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=64)


class DirectNvml(L.Callback):
    """Reads the NVML counter at synchronised epoch boundaries (the reference)."""

    def __init__(self):
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = None
        self.epoch_J = []

    def _read(self, trainer):
        from lightning_energy.measure.sensors.nvml import nvml_index_for_cuda_device

        torch.cuda.synchronize()
        index = nvml_index_for_cuda_device(self.nvml, trainer.strategy.root_device.index)
        self.handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0

    def on_train_epoch_start(self, trainer, pl_module):
        self._start = self._read(trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        self.epoch_J.append(self._read(trainer) - self._start)


@pytest.mark.parametrize("backend", ["auto", "zeus"])
def test_epoch_energy_matches_direct_nvml_and_zeus(tmp_path, backend):
    """Each epoch's GPU energy against the NVML counter read directly at synchronised epoch boundaries.

    A direct read returns the counter as of its latest 100 ms update, so the reference can be off by up to
    one period's energy (at most a period at the card's power limit); ours places each boundary inside its
    period and states how far that can be off (the row's ``bound_J``). The test requires the two together to be at most
    10 % of the epoch's energy. Epochs are sized by GPU time: with a fixed workload an H200 epoch
    lasted less than one counter period, and the test compared our 30.7 J with one counter increment, 17.9 J.
    """
    import pynvml

    energy = EnergyCallback(backend=backend, verbose=False)
    direct = DirectNvml()
    trainer = L.Trainer(callbacks=[direct, energy], **trainer_kwargs(tmp_path, accelerator="gpu", max_epochs=3,
                                                                     log_every_n_steps=5))
    trainer.fit(MatmulModel(repeats_for(EPOCH_S / EPOCH_STEPS)), loader())
    limit_W = pynvml.nvmlDeviceGetPowerManagementLimit(direct.handle) / 1000
    staleness_J = COUNTER_PERIOD_S * limit_W
    rows = energy.report["epochs"]
    for ours, reference in zip(rows[1:], direct.epoch_J[1:]):  # epoch 0 includes warm-up
        assert ours["bound_J"] is not None and ours["bound_J"] >= 0
        bound_J = staleness_J + ours["bound_J"]
        assert bound_J <= 0.1 * reference  # the epoch is long enough for the comparison to mean something
        gpu_J = sum(j for name, j in ours["per_sensor_J"].items() if "gpu" in name)
        print(f"epoch {ours['epoch']}: ours {gpu_J:.1f} J, direct {reference:.1f} J, bound {bound_J:.1f} J")
        assert gpu_J == pytest.approx(reference, abs=bound_J)
        if backend == "zeus":
            cpu_J = sum(j for n, j in ours["per_sensor_J"].items() if "cpu" in n)
            assert ours["zeus_J"] == pytest.approx(gpu_J + cpu_J, abs=bound_J)
    gpu_sensor = next(s for s in energy.report["sensors"] if "gpu" in s["name"])
    assert gpu_sensor["estimated"] is False and gpu_sensor["energy_J"] > 0
    assert all(0 < r["steps_J"] <= r["train_J"] for r in rows)


def test_telemetry_fields_are_in_the_trace(tmp_path):
    from lightning_energy.outputs.trace import read_trace

    energy = EnergyCallback(verbose=False, interval_s=0.01)
    trainer = L.Trainer(callbacks=[energy], **trainer_kwargs(tmp_path, accelerator="gpu", max_epochs=1))
    trainer.fit(MatmulModel(), loader())
    columns = read_trace(energy.trace_path)
    gpu = next(s["name"] for s in energy.report["sensors"] if s["name"].startswith("gpu"))
    for field in ("gpu_util_pct", "sm_clock_MHz", "power_W", "temperature_C"):
        assert f"{gpu}:{field}" in columns
    assert max(columns[f"{gpu}:gpu_util_pct"]) > 0


class AlternatingModel(MatmulModel):
    """Even steps keep the GPU busy for about ``step_s`` (``repeats`` chains); odd steps run one tiny chain and
    leave the GPU idle while the host sleeps ``step_s``."""

    def __init__(self, repeats: int, step_s: float):
        super().__init__(repeats)
        self.step_s = step_s

    def training_step(self, batch, batch_idx):
        if batch_idx % 2 == 0:
            return super().training_step(batch, batch_idx)
        (x,) = batch
        loss = self.net(x[:1]).square().mean()
        time.sleep(self.step_s)
        return loss


class Synchronise(L.Callback):
    """Each step's GPU work ends inside the step (placed before the energy callback)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        torch.cuda.synchronize()


class StepRecorder(EnergyCallback):
    """Keeps every step's figures, and whether the GPU's power reading had its refresh schedule pinned then."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.steps, self.pinned = [], []

    def on_step_measured(self, trainer, figures):
        self.steps.append(figures)
        phases = [series.shape_phase for series in list(self._sampler.series.values())]
        self.pinned.append(any(phase is not None and phase.pinned for phase in phases))
        super().on_step_measured(trainer, figures)


def test_100_ms_steps_alternating_busy_and_idle_pin_the_power_readings_schedule_on_a_real_card(tmp_path):
    """Steps of one counter period alternate GPU-busy and GPU-idle. The instant power refreshes on its own
    100 ms schedule (an H200's 38-82 ms after the counter's): the series must pin that schedule down from the
    readings' changes within the first half of the fit, and busy steps must then read above idle ones.

    No per-step reference exists on the card, so no ratio is asserted. On the H200 (2026-11-26) busy steps
    read 338 W and idle ones 257 W (medians, second half), where a first version of this test expected
    busy > 2 x idle. Between bursts that card stays well above its 124 W idle (about 260 W in the phase-locked
    bursts of ``benchmarks/nvml_semantics.py``' first version), so the true ratio may well be below 2; telling
    that apart from an error of the figures needs a per-step reference, which no read-only query gives.
    """
    step_s = COUNTER_PERIOD_S
    energy = StepRecorder(verbose=False)
    trainer = L.Trainer(callbacks=[Synchronise(), energy],
                        **trainer_kwargs(tmp_path, accelerator="gpu", max_epochs=1, log_every_n_steps=10))
    trainer.fit(AlternatingModel(repeats_for(step_s), step_s), loader(60))
    gpu = next(s["name"] for s in energy.report["sensors"] if s["name"].startswith("gpu"))
    assert len(energy.steps) >= 50 and all(energy.pinned[30:])
    watts = [f.measurement.energy_J[gpu] / (f.measurement.end_s - f.measurement.start_s) for f in energy.steps]
    busy, idle = statistics.median(watts[30::2]), statistics.median(watts[31::2])  # batch k is step k
    print(f"100 ms steps, second half: busy {busy:.0f} W, idle {idle:.0f} W (median per step)")
    assert busy > idle
