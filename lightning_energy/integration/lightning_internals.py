"""Every use of a private Lightning (or TensorBoard writer) attribute, one function each.

Lightning offers no public API for these; each function names what it reaches and the version it was checked
against (Lightning 2.6.6, torch 2.13). When Lightning changes, this file is the one place to look:
``tests/test_layout.py`` fails on a private attribute of another package reached anywhere else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable


# ---------------------------------------------------------------------- the fit loop
def batches_that_stepped(trainer) -> int:
    """The optimizer steps taken in this fit: the step Lightning's loggers write metrics at.

    ``trainer.global_step`` counts every optimizer's steps (two optimizers: twice as many); Lightning's logger
    connector logs at ``fit_loop.epoch_loop._batches_that_stepped`` (checked: Lightning 2.6.6)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def epoch_end_log_step(trainer) -> int:
    """The step Lightning logs a training epoch's end metrics at (``train_loss_epoch``): one less than
    :func:`batches_that_stepped` at ``on_train_epoch_end``. ``_FitLoop.on_advance_end`` lowers
    ``_batches_that_stepped`` by one around ``update_train_epoch_metrics`` "because loggers expect that the same
    step is used when logging epoch-end metrics" (checked: Lightning 2.6.6); never below 0."""
    return max(batches_that_stepped(trainer) - 1, 0)


def is_accumulating(trainer) -> bool:
    """Whether the batch that ends now only accumulates gradients (the optimizer steps at a later batch):
    ``fit_loop.epoch_loop._should_accumulate()`` (checked: Lightning 2.6.6)."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def dataloaders_come_from_the_module(trainer) -> bool:
    """Whether the fit's dataloaders are built by the LightningModule or datamodule (not passed to ``fit``):
    ``fit_loop._data_source.is_module()``, as Lightning's BatchSizeFinder checks (checked: Lightning 2.6.6)."""
    return trainer.fit_loop._data_source.is_module()


def reset_fit_dataloaders(trainer) -> None:
    """Rebuild the fit loop's training and validation dataloaders after a batch-size change, as Lightning's
    ``tuner.batch_size_scaling._reset_dataloaders`` does for the fit loop (checked: Lightning 2.6.6; theirs
    takes ``trainer._active_loop``, which is not the fit loop yet in ``on_fit_start``)."""
    loop = trainer.fit_loop
    loop._combined_loader = None
    loop.setup_data()
    loop.epoch_loop.val_loop._combined_loader = None
    loop.epoch_loop.val_loop.setup_data()


# ---------------------------------------------------------------------- batches
def first_batch_size(batch: Any) -> int | None:
    """The batch size Lightning infers for ``self.log``: the first dimension of the first tensor, depth first
    through sequences, mappings and dataclasses (a 0-d tensor counts 1); None where the batch holds no tensor.

    Lightning's public ``lightning.pytorch.utilities.data.extract_batch_size`` walks the whole batch and
    warns ("ambiguous collection ... use self.log(..., batch_size=...)") at the first leaf of another size,
    which includes every non-tensor leaf (a file name, a label string); a callback that only counts samples
    must not raise that on the user's training steps. So its generator, ``_extract_batch_size``, is taken
    here and its first size kept (checked: Lightning 2.6.6)."""
    from lightning.pytorch.utilities.data import _extract_batch_size

    try:
        return next((size for size in _extract_batch_size(batch) if size is not None), None)
    except RecursionError:
        return None


# ---------------------------------------------------------------------- the trainer's connectors
def strategy_is_distributed(trainer) -> bool:
    """Whether the trainer's strategy runs several processes: ``_accelerator_connector.is_distributed``, the
    check Lightning's BatchSizeFinder makes at setup (checked: Lightning 2.6.6)."""
    return trainer._accelerator_connector.is_distributed


def restore_checkpoint(trainer, ckpt_path: str | Path) -> None:
    """Restore the model, optimizer and loop state from ``ckpt_path`` mid-fit, as Lightning's tuner does:
    ``_checkpoint_connector.restore`` (checked: Lightning 2.6.6)."""
    trainer._checkpoint_connector.restore(ckpt_path)


def progress_bar_dict(trainer) -> dict[str, Any]:
    """The progress bar's own metrics dict, to write a value into.

    ``trainer.progress_bar_metrics`` first recomputes (and synchronises) every logged tensor, and
    ``pl_module.log`` costs ~1 ms per call; the logger connector's ``_progress_bar_metrics`` is the dict that
    getter returns (checked: Lightning 2.6.6). Falls back to the public getter where it is missing."""
    bar = getattr(trainer._logger_connector, "_progress_bar_metrics", None)
    return trainer.progress_bar_metrics if bar is None else bar


def callback_metrics_dict(trainer) -> dict[str, Any]:
    """The callback metrics' own dict, to write values into without recomputing every logged tensor: the
    logger connector's ``_callback_metrics``, the dict ``trainer.callback_metrics`` returns (checked: Lightning
    2.6.6). Falls back to the public getter where it is missing."""
    metrics = getattr(trainer._logger_connector, "_callback_metrics", None)
    return trainer.callback_metrics if metrics is None else metrics


# ---------------------------------------------------------------------- the TensorBoard logger and writer
def tensorboard_tag_prefix(logger) -> str:
    """What a TensorBoardLogger puts before each metric name (``"prefix/"``, or ``""``): its ``_prefix`` joined
    by ``LOGGER_JOIN_CHAR``, as its ``log_metrics`` does (checked: Lightning 2.6.6)."""
    return f"{logger._prefix}{logger.LOGGER_JOIN_CHAR}" if logger._prefix else ""


def writes_default_hp_metric(logger) -> bool | None:
    """Whether a TensorBoardLogger writes its ``hp_metric = -1`` hparams summary at fit start: its
    ``_default_hp_metric`` (the constructor's ``default_hp_metric``; checked: Lightning 2.6.6). None where a
    logger has no such setting."""
    return getattr(logger, "_default_hp_metric", None)


def set_writes_default_hp_metric(logger, value: bool) -> None:
    """Set what :func:`writes_default_hp_metric` reads (checked: Lightning 2.6.6)."""
    logger._default_hp_metric = value


def summary_file_writer(writer):
    """A ``torch.utils.tensorboard.SummaryWriter``'s event file writer, which takes whole ``Summary`` protos
    (several scalars in one event; an hparams summary): ``_get_file_writer()`` (checked: torch 2.13; the same
    call ``SummaryWriter.add_hparams`` makes)."""
    return writer._get_file_writer()


def closure_then_pre_step_hooks(plugin, model, optimizer, closure: Callable[[], Any]) -> Any:
    """Run the closure (forward and backward), then what Lightning runs between it and the optimizer's step:
    the ``on_before_optimizer_step`` hooks and gradient clipping, i.e. ``Precision._after_closure``.

    A protected method with no public counterpart (checked with Lightning 2.6.6; ``MixedPrecision`` calls
    it the same way). A step that may be skipped needs it: ``Precision.optimizer_step`` runs the closure
    inside ``optimizer.step``, which cannot be called off once the gradients are seen."""
    closure_result = closure()
    plugin._after_closure(model, optimizer)
    return closure_result


def optimizer_unscales_inside_step(optimizer) -> bool:
    """True for an optimizer that unscales (and skips) inside its own step (fused Adam): the gradient scaler
    then calls its step even on non-finite gradients, and only the scale's back-off tells a skipped step.

    The test ``MixedPrecision`` itself uses to decide whether to unscale: the private
    ``lightning.fabric.plugins.precision.amp._optimizer_handles_unscaling`` (no public counterpart; checked
    with Lightning 2.6.6), which reads torch's ``optimizer._step_supports_amp_scaling``."""
    from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling

    return _optimizer_handles_unscaling(optimizer)


def migrate_checkpoint(checkpoint: dict, path) -> dict:
    """``checkpoint`` (a loaded Lightning checkpoint) upgraded to this Lightning's layout, as ``Trainer.fit(
    ckpt_path=...)`` does before restoring: ``utilities.migration.utils._pl_migrate_checkpoint`` (checked:
    Lightning 2.6.6). Raises what it raises (``KeyError`` on a checkpoint of a Lightning it cannot upgrade)."""
    from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint

    return _pl_migrate_checkpoint(checkpoint, path)
