"""Baler's autoencoder training as a LightningModule.

Logged metrics (dimensionless, on normalised data):

- ``train/loss``: mean over the epoch's batches of the per-batch reconstruction loss (Baler's epoch loss),
  logged once per epoch, at the epoch's last batch (so callbacks see it in ``on_train_epoch_end``). The
  per-step values are summed on the device and never synchronised per step.
- ``train/loss_step``: the current batch's reconstruction loss every ``step_log_interval`` optimizer steps
  (0 disables it).
- ``train/total_loss``: reconstruction + regularisation, epoch mean, only when L1 or sparse-KL is enabled.
- ``val/loss``, ``test/loss``: same epoch mean on the validation / test split.

Optimiser and schedules follow Baler: Adam (lr 1e-3), ReduceLROnPlateau (factor 0.5, patience 50,
min_lr 1e-6) and early stopping (patience 100), all arguments of this class so a LightningCLI YAML sets them.
The normaliser, column names and dtypes are saved in every checkpoint (``checkpoint["baler"]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import EarlyStopping

from .errors import BalerInputError
from .losses import BalerLoss
from .models import DEFAULT_COMPRESSION_RATIO, BalerAutoencoder, build_model, resolve_dtype
from .normalization import MinMaxNormalizer

ADAM_IMPLEMENTATIONS = ("fused", "foreach", "for-loop")
#: Baler's minimum learning rate for ReduceLROnPlateau.
BALER_MIN_LR = 1e-6


class BalerModule(L.LightningModule):
    """Train one of Baler's autoencoders on min-max normalised data.

    Args:
        input_shape: shape of one sample, ``(n_columns,)`` or ``(H, W)``; the CLI links it from the data.
        model: ``"AE"``, ``"AE_Dropout_BN"`` or ``"ConvAE"``.
        compression_ratio: latent size rule ``z = ceil(n_features / ratio)`` (Baler: 1.6).
        latent_dim: explicit latent size; overrides ``compression_ratio``.
        model_kwargs: extra model arguments (``hidden``, ``channels``, ...).
        dtype: ``"float32"`` (default) or ``"float64"`` (Baler's dtype).
        loss: ``"sum"`` (Baler's Σ(x̂−x)²/n_columns per batch) or ``"mean"``.
        reg_param: L1 weight-regularisation strength (0 = off; Baler configures 0.001 but never applies it).
        rho: sparse-KL target activation of the latent units (``None`` = off; Baler configures 0.05).
        kl_weight: weight of the sparse-KL term.
        lr: Adam learning rate.
        adam: ``"fused"``, ``"foreach"`` or ``"for-loop"`` Adam implementation.
        lr_factor, lr_patience, min_lr: ReduceLROnPlateau settings (epochs); ``lr_patience=None`` disables it.
        early_stopping_patience: epochs without improvement before stopping; ``None`` disables it.
        early_stopping_min_delta: minimum improvement of the monitored loss.
        monitor: metric for the scheduler and early stopping; ``"auto"`` uses ``val/loss`` when the data module
            has a validation split and ``train/loss`` otherwise.
        step_log_interval: log ``train/loss_step`` every this many steps (0 = epoch means only).
    """

    def __init__(
        self,
        input_shape: Sequence[int] | None = None,
        model: str = "AE",
        compression_ratio: float = DEFAULT_COMPRESSION_RATIO,
        latent_dim: int | None = None,
        model_kwargs: dict[str, Any] | None = None,
        dtype: str = "float32",
        loss: str = "sum",
        reg_param: float = 0.0,
        rho: float | None = None,
        kl_weight: float = 1.0,
        lr: float = 1e-3,
        adam: str = "fused",
        lr_factor: float = 0.5,
        lr_patience: int | None = 50,
        min_lr: float = BALER_MIN_LR,
        early_stopping_patience: int | None = 100,
        early_stopping_min_delta: float = 0.0,
        monitor: str = "auto",
        step_log_interval: int = 0,
    ) -> None:
        super().__init__()
        if input_shape is None:
            raise BalerInputError("input_shape is required (the baler-lit CLI links it from data.input_shape)")
        if adam not in ADAM_IMPLEMENTATIONS:
            raise BalerInputError(f"adam must be one of {ADAM_IMPLEMENTATIONS}, got {adam!r}")
        if lr <= 0:
            raise BalerInputError(f"lr must be > 0, got {lr}")
        if step_log_interval < 0:
            raise BalerInputError(f"step_log_interval must be >= 0, got {step_log_interval}")
        self.save_hyperparameters()
        self.model: BalerAutoencoder = build_model(
            model, input_shape, latent_dim, compression_ratio, dtype, model_kwargs
        )
        self.criterion = BalerLoss(loss, reg_param, rho, kl_weight)
        self.to(resolve_dtype(dtype))
        self.normalizer: MinMaxNormalizer | None = None
        self.column_names: list[str] = []
        self.column_dtypes: list[str] = []
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning's hook dispatch sets ``_current_fx_name`` about 45 times per training step; nn.Module's
        # __setattr__ (parameter/buffer/module bookkeeping) costs ~5 µs each time. This plain attribute is
        # never a parameter, buffer or sub-module, so it can skip that bookkeeping.
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    # -- data description ----------------------------------------------------------------------------
    @property
    def latent_dim(self) -> int:
        return self.model.latent_dim

    def set_data_info(self, normalizer: MinMaxNormalizer, names: list[str], dtypes: list[str]) -> None:
        """Attach the normaliser and column description that compression needs."""
        self.normalizer = normalizer
        self.column_names = list(names)
        self.column_dtypes = list(dtypes)

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is None or not hasattr(datamodule, "table"):
            return
        table = datamodule.table
        if tuple(table.sample_shape) != tuple(self.model.input_shape):
            raise BalerInputError(
                f"column-count mismatch: the model expects samples of shape {tuple(self.model.input_shape)},"
                f" the data {table.source} has {tuple(table.sample_shape)}"
            )
        if stage == "fit" or self.normalizer is None:
            self.set_data_info(datamodule.normalizer, table.names, table.dtypes)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.normalizer is not None:
            checkpoint["baler"] = {
                "norm_min": self.normalizer.minimum.tolist(),
                "norm_scale": self.normalizer.scale.tolist(),
                "names": self.column_names,
                "dtypes": self.column_dtypes,
            }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        info = checkpoint.get("baler")
        if info is not None:
            arrays = {k: np.asarray(info[k], dtype=np.float64) for k in ("norm_min", "norm_scale")}
            self.set_data_info(MinMaxNormalizer.from_arrays(arrays), info["names"], info["dtypes"])

    # -- forward and steps ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Reconstruct a batch of normalised samples."""
        return self.model(x)

    def _accumulate(self, split: str, value: torch.Tensor) -> None:
        if split in self._sums:
            self._sums[split] += value.detach()
        else:
            self._sums[split] = value.detach().clone()
        self._counts[split] = self._counts.get(split, 0) + 1

    def _log_mean(self, split: str, name: str, prog_bar: bool = False) -> None:
        if self._counts.get(split):
            mean = self._sums.pop(split) / self._counts.pop(split)
            self.log(name, mean, on_step=False, on_epoch=True, prog_bar=prog_bar, sync_dist=True)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        total, recon = self.criterion(self.model, batch)
        self._accumulate("train", recon)
        if total is not recon:
            self._accumulate("train_total", total)
        k = self.hparams.step_log_interval
        if k and self.global_step % k == 0:
            self.log("train/loss_step", recon.detach(), on_step=True, on_epoch=False)
        if batch_idx + 1 >= self.trainer.num_training_batches:
            # log the epoch mean at the last batch so every callback's on_train_epoch_end can read it
            self._log_train_means()
        return total

    def _log_train_means(self) -> None:
        self._log_mean("train", "train/loss", prog_bar=True)
        self._log_mean("train_total", "train/total_loss")

    def on_train_epoch_end(self) -> None:
        self._log_train_means()  # epochs cut short (e.g. max_steps) still get their mean

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        _, recon = self.criterion(self.model, batch)
        self._accumulate("val", recon)

    def on_validation_epoch_end(self) -> None:
        self._log_mean("val", "val/loss", prog_bar=True)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        _, recon = self.criterion(self.model, batch)
        self._accumulate("test", recon)

    def on_test_epoch_end(self) -> None:
        self._log_mean("test", "test/loss")

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        """Latent codes and reconstructions; reconstructions in physical units when a normaliser is known."""
        z = self.model.encode(batch)
        x_hat = self.model.decode(z)
        if self.normalizer is not None:
            x_hat = self.normalizer.inverse_torch(x_hat)
        return {"latent": z, "reconstruction": x_hat}

    # -- optimisation --------------------------------------------------------------------------------
    def _monitor(self) -> str:
        if self.hparams.monitor != "auto":
            return self.hparams.monitor
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        has_val = getattr(datamodule, "has_validation", True)
        return "val/loss" if has_val else "train/loss"

    def configure_optimizers(self) -> dict[str, Any]:
        impl = self.hparams.adam
        kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr, **kwargs)
        if self.hparams.lr_patience is None:
            return {"optimizer": optimizer}
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer,
            mode="min",
            factor=self.hparams.lr_factor,
            patience=self.hparams.lr_patience,
            min_lr=self.hparams.min_lr,
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "monitor": self._monitor(), "interval": "epoch"},
        }

    def configure_callbacks(self) -> list[L.Callback]:
        if self.hparams.early_stopping_patience is None:
            return []
        return [
            EarlyStopping(
                monitor=self._monitor(),
                patience=self.hparams.early_stopping_patience,
                min_delta=self.hparams.early_stopping_min_delta,
                mode="min",
            )
        ]
