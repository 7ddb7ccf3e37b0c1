"""On a CUDA GPU: our per-epoch energy against a direct NVML counter delta and against Zeus.

Read-only NVML queries only (never clocks or power limits). Skipped without CUDA.
"""

from __future__ import annotations

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


class MatmulModel(L.LightningModule):
    """Enough GPU work per epoch (~1-2 s) for the 0.1 s NVML counter to resolve it well."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.net(x).square().mean()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def loader():
    x = torch.randn(64 * 40, 4096)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=64)


class DirectNvml(L.Callback):
    """Reads the NVML counter at synchronised epoch boundaries (the reference)."""

    def __init__(self):
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.epoch_J = []

    def _read(self, trainer):
        from lightning_energy.measure.sensors.nvml import nvml_index_for_cuda_device

        torch.cuda.synchronize()
        handle = self.nvml.nvmlDeviceGetHandleByIndex(nvml_index_for_cuda_device(self.nvml, trainer.strategy.root_device.index))
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0

    def on_train_epoch_start(self, trainer, pl_module):
        self._start = self._read(trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        self.epoch_J.append(self._read(trainer) - self._start)


@pytest.mark.parametrize("backend", ["auto", "zeus"])
def test_epoch_energy_matches_direct_nvml_and_zeus(tmp_path, backend):
    energy = EnergyCallback(backend=backend, verbose=False)
    direct = DirectNvml()
    trainer = L.Trainer(callbacks=[direct, energy], **trainer_kwargs(tmp_path, accelerator="gpu", max_epochs=3,
                                                                     log_every_n_steps=5))
    trainer.fit(MatmulModel(), loader())
    for ours, reference in zip(energy.report["epochs"][1:], direct.epoch_J[1:]):  # epoch 0 includes warm-up
        gpu_J = sum(j for name, j in ours["per_sensor_J"].items() if "gpu" in name)
        assert gpu_J == pytest.approx(reference, rel=0.1, abs=5.0)
        if backend == "zeus":
            assert ours["zeus_J"] == pytest.approx(gpu_J + sum(j for n, j in ours["per_sensor_J"].items() if "cpu" in n),
                                                   rel=0.1, abs=5.0)
    gpu_sensor = next(s for s in energy.report["sensors"] if "gpu" in s["name"])
    assert gpu_sensor["estimated"] is False and gpu_sensor["energy_J"] > 0
    rows = energy.report["epochs"]
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
