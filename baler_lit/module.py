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
The normaliser, column names and dtypes are saved in every checkpoint (``checkpoint["baler"]``); ``baler-lit
compress`` reads them back without Lightning (:func:`baler_lit.cli.load_checkpoint`).

:class:`BalerCheckpoint` is the checkpoint callback of the shipped configs: it monitors what exists
(``val/loss`` with a validation split, ``train/loss`` without, as Baler's default ``test_size = 0``) and keeps
the best weights in memory, writing the file at most every ``write_interval_s`` and at the end of the fit, so
a one-batch epoch does not pay a multi-megabyte file write.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities.model_helpers import is_overridden

from .errors import BalerInputError
from .losses import BalerLoss
from .models import DEFAULT_COMPRESSION_RATIO, BalerAutoencoder, build_model, resolve_dtype
from .normalization import MinMaxNormalizer

ADAM_IMPLEMENTATIONS = ("fused", "foreach", "for-loop")
#: Baler's minimum learning rate for ReduceLROnPlateau.
BALER_MIN_LR = 1e-6
_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad


class BalerModule(L.LightningModule):
    """Train one of Baler's autoencoders on min-max normalised data.

    Args:
        input_shape: shape of one sample, ``(n_columns,)`` or ``(H, W)``; the CLI links it from the data.
        model: ``"AE"``, ``"AE_Dropout_BN"`` or ``"ConvAE"``.
        compression_ratio: latent size rule ``z = ceil(n_features / ratio)`` (Baler: 1.6).
        latent_dim: explicit latent size; overrides ``compression_ratio``.
        model_kwargs: extra model arguments (``hidden``, ``channels``, ...).
        dtype: ``"float32"`` (default) or ``"float64"`` (Baler's dtype).
        loss: ``"sum"`` (Baler's Σ(x̂−x)²/n_columns per batch), ``"mean"`` or ``"swae"`` (``"sum"`` plus Baler's
            sliced-Wasserstein term, ``loss_function_swae``).
        reg_param: L1 weight-regularisation strength (0 = off; Baler configures 0.001 but never applies it).
        rho: sparse-KL target activation of the latent units (``None`` = off; Baler configures 0.05).
        kl_weight: weight of the sparse-KL term.
        swd_weight, swd_projections: weight and projections of the ``"swae"`` term (Baler: 100, 2000).
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
        swd_weight: float = 100.0,
        swd_projections: int = 2000,
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
        self.criterion = BalerLoss(loss, reg_param, rho, kl_weight, swd_weight, swd_projections)
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
        # a BalerDataModule's ``rows`` describes the input without loading it (``table`` would, even when streaming)
        table = datamodule.rows if hasattr(type(datamodule), "rows") else getattr(datamodule, "table", None)
        if table is None:
            return
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

    # -- per-step hook, without machinery this module does not need -------------------------------------
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.zero_grad()`` (set to None), as Lightning's default does, without its per-call profiler
        range while no profiler runs: the same gradients (None); zero_grad was 2 % of a bare Lightning step of
        the Baler AE (py-spy, 34k rows, batch 512, float32).

        Only for optimizers that keep ``torch.optim.Optimizer.zero_grad``; any other (or a running profiler)
        gets its own ``zero_grad``.
        """
        if type(optimizer).zero_grad is _TORCH_ZERO_GRAD and not torch.autograd._profiler_enabled():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None
        else:
            optimizer.zero_grad()

    # -- optimisation --------------------------------------------------------------------------------
    def monitored_metric(self) -> str:
        """The metric the scheduler, early stopping and :class:`BalerCheckpoint` follow (see ``monitor``)."""
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
            "lr_scheduler": {"scheduler": scheduler, "monitor": self.monitored_metric(), "interval": "epoch"},
        }

    def configure_callbacks(self) -> list[L.Callback]:
        if self.hparams.early_stopping_patience is None:
            return []
        return [
            EarlyStopping(
                monitor=self.monitored_metric(),
                patience=self.hparams.early_stopping_patience,
                min_delta=self.hparams.early_stopping_min_delta,
                mode="min",
            )
        ]


# Lightning reads ``training_step``'s signature at every step (``inspect.getfullargspec``, to decide whether to pass
# ``batch_idx``): about 30 us to parse it anew each time, 5 us from the signature stored here (the same signature).
BalerModule.training_step.__signature__ = inspect.signature(BalerModule.training_step)


class BalerCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that monitors what exists and writes the best weights at most every few seconds.

    Args:
        monitor: ``"auto"`` (default) follows the module's :meth:`BalerModule.monitored_metric`: ``val/loss``
            with a validation split, ``train/loss`` without (for another LightningModule: ``val/loss`` if it
            has a ``validation_step``); any other value is used as is.
        write_interval_s: with ``save_top_k=1`` on one process, a new best is copied into preallocated
            in-memory buffers (one ``_foreach_copy_`` of the weights, about 0.1 ms per MB) and the file is
            written when at least this many seconds have passed since the last write, and always at the end of
            the fit or when it fails. ``0`` writes every new best at once (``ModelCheckpoint``'s behaviour).
        **kwargs: every other ``ModelCheckpoint`` argument (``filename``, ``dirpath``, ``mode``, ...).

    A deferred file is a weights-only Lightning checkpoint of the best epoch (``state_dict``, hyper-parameters,
    the ``baler`` section, that epoch's ``epoch``/``global_step``): ``baler-lit compress`` and
    ``BalerModule.load_from_checkpoint`` read it; to resume a fit, add a second checkpoint with ``save_last``.
    """

    def __init__(self, monitor: str | None = "auto", write_interval_s: float = 60.0, **kwargs: Any) -> None:
        kwargs.setdefault("mode", "min")
        super().__init__(monitor=monitor, **kwargs)
        if write_interval_s < 0:
            raise BalerInputError(f"write_interval_s must be >= 0, got {write_interval_s}")
        self.write_interval_s = float(write_interval_s)
        self._in_topk = False
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._live: list[torch.Tensor] = []
        self._pending: tuple[str, int, int] | None = None
        self._last_write = time.monotonic()

    @property
    def state_key(self) -> str:
        # ModelCheckpoint's key (the same string, so checkpoints stay interchangeable), built once per setting:
        # Lightning reads it at every hook call of every callback (~6 times a step), and building it reprs a dict
        settings = (self.monitor, self.mode, self._every_n_train_steps, self._every_n_epochs,
                    self._train_time_interval)
        cached = self.__dict__.get("_state_key_cache")
        if cached is None or cached[0] != settings:
            cached = self._state_key_cache = (settings, ModelCheckpoint.state_key.fget(self))
        return cached[1]

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.monitor == "auto":
            monitored = getattr(pl_module, "monitored_metric", None)
            if callable(monitored):
                self.monitor = monitored()
            else:  # another LightningModule: val/loss if it validates at all
                self.monitor = "val/loss" if is_overridden("validation_step", pl_module) else "train/loss"
        super().setup(trainer, pl_module, stage)
        self._last_write = time.monotonic()

    def _defers(self, trainer: L.Trainer) -> bool:
        return self._in_topk and self.write_interval_s > 0 and self.save_top_k == 1 and trainer.world_size == 1

    def _save_topk_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        self._in_topk = True
        try:
            super()._save_topk_checkpoint(trainer, monitor_candidates)
        finally:
            self._in_topk = False

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        if not self._defers(trainer):
            super()._save_checkpoint(trainer, filepath)
            return
        self._take_snapshot(trainer.lightning_module)
        self._pending = (filepath, trainer.current_epoch, trainer.global_step)
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if time.monotonic() - self._last_write >= self.write_interval_s:
            self.write_pending(trainer)

    def _take_snapshot(self, pl_module: L.LightningModule) -> None:
        if self._snapshot is None:
            state = pl_module.state_dict()
            self._live = [t.detach() for t in state.values()]
            self._snapshot = {k: t.detach().clone() for k, t in state.items()}
        else:
            torch._foreach_copy_(list(self._snapshot.values()), self._live)

    def write_pending(self, trainer: L.Trainer) -> None:
        """Write the best weights held in memory, if newer than the file."""
        if self._pending is None or self._snapshot is None:
            return
        filepath, epoch, step = self._pending
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=True)
        checkpoint.pop("loops", None)  # the loops have moved on since the best epoch
        checkpoint.update(state_dict=self._snapshot, epoch=epoch, global_step=step)
        trainer.strategy.save_checkpoint(checkpoint, filepath)
        self._pending = None
        self._last_write = time.monotonic()
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write_pending(trainer)
        super().on_train_end(trainer, pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.write_pending(trainer)
        super().on_exception(trainer, pl_module, exception)
