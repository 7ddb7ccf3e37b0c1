"""A tiny LightningModule with its own synthetic data, the built-in model of ``configs/sweep_tiny.yaml``.

It trains in well under a second per epoch on one CPU core, so sweeps and demos of the tooling run
anywhere; it says nothing about the energy of real models.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from typing_extensions import override


class TinyAutoencoder(L.LightningModule):
    """A small dense autoencoder (in -> hidden -> latent -> hidden -> in) on random correlated data.

    Args:
        in_features: columns of the synthetic data.
        hidden: width of the hidden layers.
        latent: size of the bottleneck.
        n_train, n_val: rows of training and validation data.
        batch_size: rows per batch (the sweep's ``batch_size`` axis sets it).
        lr: Adam learning rate.
        seed: seed of the synthetic data.
    """

    def __init__(self, in_features: int = 24, hidden: int = 32, latent: int = 8, n_train: int = 1024,
                 n_val: int = 256, batch_size: int = 64, lr: float = 1e-3, seed: int = 0) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("hidden", hidden), ("latent", latent),
                            ("n_train", n_train), ("n_val", n_val), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(in_features, hidden), nn.LeakyReLU(0.01), nn.Linear(hidden, latent))
        self.decoder = nn.Sequential(nn.Linear(latent, hidden), nn.LeakyReLU(0.01), nn.Linear(hidden, in_features))
        self._data: dict[str, torch.Tensor] = {}

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))

    def _make_data(self) -> None:
        g = torch.Generator().manual_seed(self.hparams.seed)
        n = self.hparams.n_train + self.hparams.n_val
        factors = torch.randn(n, self.hparams.latent, generator=g)
        mixing = torch.randn(self.hparams.latent, self.hparams.in_features, generator=g)
        x = factors @ mixing + 0.05 * torch.randn(n, self.hparams.in_features, generator=g)
        self._data = {"train": x[: self.hparams.n_train], "val": x[self.hparams.n_train:]}

    @override
    def setup(self, stage: str) -> None:
        if not self._data:
            self._make_data()

    def _loader(self, split: str) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self._data[split]),
                                           batch_size=self.hparams.batch_size)

    @override
    def train_dataloader(self):
        return self._loader("train")

    @override
    def val_dataloader(self):
        return self._loader("val")

    def _loss(self, batch) -> torch.Tensor:
        (x,) = batch
        return nn.functional.mse_loss(self(x).float(), x.float())

    @override
    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train/loss", loss, batch_size=batch[0].shape[0])
        return loss

    @override
    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self._loss(batch), batch_size=batch[0].shape[0])

    @override
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
