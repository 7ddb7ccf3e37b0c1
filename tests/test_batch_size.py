"""BatchSizeSearch on fake time: to a validation target (real training, simulated step costs on a clocked
energy counter) and per sample (the simulated GPU), each choice applied like BatchSizeFinder's."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from conftest import trainer_kwargs
from lightning_energy.callbacks.batch_size import BatchSizeSearch
from lightning_energy.simulate.gpu_sim import SimulatedGPU, SimulatedWorkload
from power_limit_helpers import RecordingLogger, install_fake_time
from precision_helpers import ClockedEnergyCounter

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
    search = BatchSizeSearch(CANDIDATES, method="per_sample", cost=cost, gpu=gpu, warmup_steps=1, steps=3)
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
    search = BatchSizeSearch([16, 64, 256], method="per_sample", cost="time", gpu=gpu, warmup_steps=0, steps=2)
    data = DataModule()
    trainer = L.Trainer(callbacks=[search, SimulatedWorkload(gpu=gpu)],
                        **trainer_kwargs(tmp_path, max_epochs=1, limit_train_batches=2, logger=False))
    trainer.fit(PlainModule(), datamodule=data)
    assert search.chosen_batch_size == 64 and data.batch_size == 64


def test_setup_refusals_name_the_problem(tmp_path, clock):
    """At setup, before training (the constructor's refusals: test_callback_arguments.py)."""
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=8)
    trainer = L.Trainer(callbacks=[BatchSizeSearch([8, 16], method="per_sample")],
                        **trainer_kwargs(tmp_path, logger=False))
    with pytest.raises(MisconfigurationException, match="passed to `.fit"):
        trainer.fit(PlainModule(), loader)
    trainer = L.Trainer(callbacks=[BatchSizeSearch([8, 16], method="per_sample", cost="zeus_cost")],
                        **trainer_kwargs(tmp_path, logger=False))
    with pytest.raises(MisconfigurationException, match="max_power_W"):
        trainer.fit(HparamsModule())
    trainer = L.Trainer(callbacks=[BatchSizeSearch([8, 16], monitor="val/loss", target=0.1)],
                        **trainer_kwargs(tmp_path, logger=False))
    with pytest.raises(MisconfigurationException, match="validation loop"):
        trainer.fit(HparamsModule())  # no validation: a target can never be seen


# ---------------------------------------------------------------------- to a validation target
# A linear regression trained with SGD (fixed seeds, no shuffling: the same steps every run) on simulated
# hardware whose step takes OVERHEAD_S + PER_SAMPLE_S * b at STEP_W: bigger batches cost less per sample
# but need about as many optimizer steps to reach the target, so the largest batch costs the most to get there.
FEATURES, TRAIN_ROWS, VAL_ROWS = 8, 1024, 256
OVERHEAD_S, PER_SAMPLE_S, STEP_W = 0.002, 2e-5, 200.0
TARGET_MSE = 0.05
SIZES = [8, 32, 128, 512]


class RegressionModule(L.LightningModule):
    """y = X w + 0.1 noise; the loaders take ``hparams.batch_size``; ``val/loss`` is the validation MSE."""

    def __init__(self, batch_size: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(TRAIN_ROWS, FEATURES, generator=g)
        w = torch.randn(FEATURES, 1, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(TRAIN_ROWS, 1, generator=g)
        self.x_val = torch.randn(VAL_ROWS, FEATURES, generator=g)
        self.y_val = self.x_val @ w + 0.1 * torch.randn(VAL_ROWS, 1, generator=g)
        torch.manual_seed(0)
        self.layer = nn.Linear(FEATURES, 1)
        self.trained_batches: list[int] = []

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(self.x, self.y)
        return torch.utils.data.DataLoader(data, batch_size=self.hparams.batch_size)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x_val, self.y_val), batch_size=VAL_ROWS)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.trained_batches.append(x.shape[0])
        return nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def step_s(b: int) -> float:
    return OVERHEAD_S + PER_SAMPLE_S * b


class SimulatedSteps(L.Callback):
    """Each training step of ``b`` samples draws STEP_W for ``step_s(b)`` fake seconds on the counter."""

    keep_during_trials = True  # it stands for the hardware

    def __init__(self, counter: ClockedEnergyCounter) -> None:
        self.counter = counter

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.counter.run(STEP_W, step_s(batch[0].shape[0]))


def target_fit(tmp_path, clock, estimated=False, **kwargs):
    counter = ClockedEnergyCounter(clock, name="simgpu", estimated=estimated)
    kwargs.setdefault("cost", "energy")
    search = BatchSizeSearch(SIZES, monitor="val/loss", target=TARGET_MSE, mode="min", sensors=[counter],
                             trial_max_epochs=40, **kwargs)
    module = RegressionModule()
    initial = module.layer.weight.detach().clone()
    weights = WeightsAtTrainStart()
    trainer = L.Trainer(callbacks=[search, SimulatedSteps(counter), weights],
                        **trainer_kwargs(tmp_path, max_epochs=1, logger=False, num_sanity_val_steps=0))
    trainer.fit(module)
    assert torch.equal(weights.weights, initial)  # training started from the weights every trial started from
    return search, module


def test_to_target_picks_a_smaller_batch_when_the_largest_costs_more_to_reach_the_target(tmp_path, clock):
    search, module = target_fit(tmp_path, clock, beta_knob=None)
    rows = {r["batch_size"]: r for r in search.results}
    assert all(r["failure"] is None and r["reached"] for r in rows.values())
    for b, r in rows.items():  # exact: the counter integrates STEP_W over the simulated steps only
        assert r["energy_J"] == pytest.approx(r["steps"] * STEP_W * step_s(b), rel=1e-9)
        assert r["time_s"] == pytest.approx(r["steps"] * step_s(b), rel=1e-9)
        assert r["metric"] <= TARGET_MSE and r["cost"] == r["energy_J"]
    # the scenario: per sample the largest batch is the cheapest (what a per-sample search picks) ...
    assert min(rows, key=lambda b: rows[b]["energy_per_sample_J"]) == max(SIZES)
    # ... but it needs more energy to reach the target than a smaller batch: the search picks the cheapest
    best = min(rows, key=lambda b: rows[b]["energy_J"])
    assert best < max(SIZES) and rows[max(SIZES)]["energy_J"] > 1.5 * rows[best]["energy_J"]
    assert search.chosen_batch_size == best and module.hparams.batch_size == best
    assert module.trained_batches[-1] == best  # training ran with the choice
    saved = json.loads(search.result_file.read_text())
    assert (saved["method"], saved["cost"], saved["cost_per"], saved["chosen_batch_size"]) == (
        "to_target", "energy", "run to target", best)
    assert saved["energy_estimated"] is False and saved["energy_label"] == "measured"


def test_zeus_cost_to_target_and_pruning_of_a_bad_arm(tmp_path, clock):
    eta, max_power = 0.5, 300.0
    search, _ = target_fit(tmp_path, clock, cost="zeus_cost", eta_knob=eta, max_power_W=max_power, beta_knob=2.0)
    rows = {r["batch_size"]: r for r in search.results}
    finished = {b: r for b, r in rows.items() if r["failure"] is None}
    for r in rows.values():
        assert r["cost"] == pytest.approx(eta * r["energy_J"] + (1 - eta) * max_power * r["time_s"], rel=1e-12)
    best = min(finished, key=lambda b: finished[b]["cost"])
    assert search.chosen_batch_size == best < max(SIZES)
    pruned = rows[max(SIZES)]  # tried last: stopped once its cost so far passed 2x the best finished one
    assert pruned["failure"].startswith("pruned: cost so far") and not pruned["reached"]
    assert pruned["cost"] > 2.0 * min(r["cost"] for b, r in finished.items() if b < max(SIZES))
    unpruned, _ = target_fit(tmp_path / "unpruned", clock, cost="zeus_cost", eta_knob=eta, max_power_W=max_power,
                             beta_knob=None)
    full = {r["batch_size"]: r for r in unpruned.results}[max(SIZES)]
    assert full["reached"] and pruned["steps"] < full["steps"]  # pruning saved steps


def test_to_target_json_labels_cpu_estimates(tmp_path, clock):
    search, _ = target_fit(tmp_path, clock, estimated=True)
    saved = json.loads(search.result_file.read_text())
    assert saved["energy_estimated"] is True and saved["energy_label"] == "CPU estimate"
    assert saved["energy_sensors"] == ["simgpu"]


def test_a_candidate_that_never_reaches_the_target_is_not_chosen(tmp_path, clock):
    counter = ClockedEnergyCounter(clock, name="simgpu")
    search = BatchSizeSearch([32, 512], monitor="val/loss", target=TARGET_MSE, sensors=[counter], trial_max_epochs=3,
                             beta_knob=None)
    trainer = L.Trainer(callbacks=[search, SimulatedSteps(counter)],
                        **trainer_kwargs(tmp_path, max_epochs=1, logger=False, num_sanity_val_steps=0))
    trainer.fit(RegressionModule())
    rows = {r["batch_size"]: r for r in search.results}
    assert rows[512]["failure"] == f"val/loss did not reach {TARGET_MSE:g} in 3 epochs" and not rows[512]["reached"]
    assert search.chosen_batch_size == 32


def test_per_sample_method_picks_the_largest_batch_in_the_same_scenario(tmp_path, clock):
    """What the old search did (and ``method="per_sample"`` still does, by name): the largest batch, which costs
    the most to reach the target above."""
    counter = ClockedEnergyCounter(clock, name="simgpu")
    search = BatchSizeSearch(SIZES, method="per_sample", sensors=[counter], warmup_steps=0, steps=2)
    trainer = L.Trainer(callbacks=[search, SimulatedSteps(counter)],
                        **trainer_kwargs(tmp_path, max_epochs=1, logger=False, num_sanity_val_steps=0))
    trainer.fit(RegressionModule())
    assert search.chosen_batch_size == max(SIZES)
    for r in search.results:
        assert r["energy_per_sample_J"] == pytest.approx(STEP_W * step_s(r["batch_size"]) / r["batch_size"], rel=1e-9)
    saved = json.loads(search.result_file.read_text())
    assert (saved["method"], saved["cost_per"]) == ("per_sample", "sample")


def test_batch_length_counts_samples_as_lightning_logs_them():
    """Lightning's rule (``extract_batch_size``: first tensor, depth first, through dataclasses and mappings)
    without its "ambiguous collection" warning on a batch that carries non-tensor metadata."""
    from dataclasses import dataclass

    from lightning.pytorch.utilities.data import extract_batch_size

    from lightning_energy.integration.lightning_internals import first_batch_size as batch_length

    @dataclass
    class Batch:
        features: torch.Tensor
        target: torch.Tensor

    batches = [Batch(torch.zeros(5, 2), torch.zeros(5)), ([torch.zeros(4)], torch.zeros(4)),
               {"x": torch.zeros(3, 1), "y": torch.zeros(3)}, torch.tensor(1.0)]
    assert [batch_length(b) for b in batches] == [extract_batch_size(b) for b in batches] == [5, 4, 3, 1]
    assert batch_length(([torch.zeros(4)], torch.zeros(8))) == 4  # depth first, as Lightning
    assert batch_length({"names": ["a.root", "b.root"], "x": torch.zeros(2, 7)}) == 2  # no warning (error here)
    assert batch_length(["a", 1, None]) is None
