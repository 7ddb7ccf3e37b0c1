"""BatchSizeSearch against the simulated GPU on fake time: the known best per cost, applied like BatchSizeFinder."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from conftest import trainer_kwargs
from lightning_energy.callbacks.batch_size import BatchSizeSearch
from lightning_energy.gpu_sim import SimulatedGPU, SimulatedWorkload
from power_limit_helpers import RecordingLogger, install_fake_time

CANDIDATES = [16, 32, 64, 128, 256, 512]  # 512 needs 2 GiB + 512 x 48 MiB > 16 GiB: out of memory
MAX_POWER_W = 300.0


@pytest.fixture
def clock(monkeypatch):
    return install_fake_time(monkeypatch.setattr)


def per_sample(gpu: SimulatedGPU, b: int) -> tuple[float, float]:
    """The simulator's exact J and s per sample for a batch of ``b`` at the default (maximum) limit."""
    return gpu.step_energy_J(300, b) / b, gpu.step_time_s(300, b) / b


def known_best(gpu: SimulatedGPU, cost: str, eta: float = 0.5) -> int:
    def value(b):
        e, t = per_sample(gpu, b)
        return {"energy": e, "time": t, "zeus_cost": eta * e + (1 - eta) * MAX_POWER_W * t}[cost]
    return min(CANDIDATES[:-1], key=value)


class HparamsModule(L.LightningModule):
    """Builds its loader from ``hparams.batch_size`` and records the batch sizes it trains on."""

    def __init__(self, batch_size: int = 8, rows: int = 2048) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(4, 1)
        self.trained_batches: list[int] = []

    def train_dataloader(self):
        x = torch.randn(self.hparams.rows, 4, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=self.hparams.batch_size)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.trained_batches.append(x.shape[0])
        return self.layer(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class WeightsAtTrainStart(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.weights = pl_module.layer.weight.detach().clone()


def test_sim_costs_have_distinct_optima():
    gpu = SimulatedGPU()
    assert (known_best(gpu, "energy"), known_best(gpu, "time"), known_best(gpu, "zeus_cost")) == (32, 128, 128)


@pytest.mark.parametrize("cost", ["energy", "time", "zeus_cost"])
def test_search_picks_the_known_best_and_applies_it(tmp_path, clock, cost):
    gpu = SimulatedGPU(clock=clock)
    search = BatchSizeSearch(CANDIDATES, cost=cost, gpu=gpu, warmup_steps=1, steps=3)
    module = HparamsModule()
    initial = module.layer.weight.detach().clone()
    weights = WeightsAtTrainStart()
    logger = RecordingLogger()
    trainer = L.Trainer(callbacks=[search, SimulatedWorkload(gpu=gpu), weights],
                        **trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=3, logger=[logger]))
    trainer.fit(module)
    best = known_best(gpu, cost)
    assert search.chosen_batch_size == best
    assert module.hparams.batch_size == best
    assert module.trained_batches[-3:] == [best] * 3  # training ran with the choice ...
    assert torch.equal(weights.weights, initial)  # ... from the weights the trials started from
    rows = {r["batch_size"]: r for r in search.results}
    assert rows[512]["failure"].startswith("out of memory")
    for b in CANDIDATES[:-1]:
        e, t = per_sample(gpu, b)
        assert rows[b]["samples"] == 3 * b
        assert rows[b]["energy_per_sample_J"] == pytest.approx(e, rel=1e-9)
        assert rows[b]["time_per_sample_s"] == pytest.approx(t, rel=1e-9)
        assert rows[b]["peak_memory_B"] == gpu.step.memory_B(b)
    logged = {k: v for _, m in logger.metrics for k, v in m.items()}
    assert logged["batch_size/chosen"] == best
    assert logged[f"batch_size/{best}/cost"] == pytest.approx(rows[best]["cost"])
    saved = json.loads(search.result_file.read_text())
    assert saved["chosen_batch_size"] == best and len(saved["candidates"]) == len(CANDIDATES)
    assert trainer.global_step == 3  # the trials' steps do not count


class DataModule(L.LightningDataModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        x = torch.randn(2048, 4, generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=self.batch_size)


class PlainModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_datamodule_attribute_is_set(tmp_path, clock):
    gpu = SimulatedGPU(clock=clock)
    search = BatchSizeSearch([16, 64, 256], cost="time", gpu=gpu, warmup_steps=0, steps=2)
    data = DataModule()
    trainer = L.Trainer(callbacks=[search, SimulatedWorkload(gpu=gpu)],
                        **trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=2, logger=False))
    trainer.fit(PlainModule(), datamodule=data)
    assert search.chosen_batch_size == 64 and data.batch_size == 64


def test_refusals_name_the_problem(tmp_path, clock):
    with pytest.raises(ValueError, match="batch_sizes"):
        BatchSizeSearch([])
    with pytest.raises(ValueError, match="cost"):
        BatchSizeSearch([8], cost="carbon")
    with pytest.raises(ValueError, match="interval_s"):  # at construction, as every suite callback
        BatchSizeSearch([8], interval_s=0.0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=8)
    trainer = L.Trainer(callbacks=[BatchSizeSearch([8, 16])], **trainer_kwargs(tmp_path, logger=False))
    with pytest.raises(MisconfigurationException, match="passed to `.fit"):
        trainer.fit(PlainModule(), loader)
    trainer = L.Trainer(callbacks=[BatchSizeSearch([8, 16], cost="zeus_cost")], **trainer_kwargs(tmp_path, logger=False))
    with pytest.raises(MisconfigurationException, match="max_power_W"):
        trainer.fit(HparamsModule())
