"""TensorBoard extras: a custom-scalars layout (loss beside energy) and a per-epoch power figure."""

from __future__ import annotations

import math
import re

from lightning_energy.sampler import Reading

MAX_FIGURE_POINTS = 4000  # per epoch; older points are thinned by half when exceeded


class EpochPowerRecorder:
    """A sampler listener keeping this epoch's power per sensor (W), thinned to a bounded size."""

    def __init__(self) -> None:
        self.points: list[tuple[float, dict[str, float]]] = []

    def start_epoch(self) -> None:
        self.points = []

    def take(self) -> list[tuple[float, dict[str, float]]]:
        points, self.points = self.points, []
        return points

    def __call__(self, t: float, readings: list[Reading]) -> None:
        points = self.points
        points.append((t, {r.name: r.power_W for r in readings if math.isfinite(r.power_W)}))
        if len(points) > MAX_FIGURE_POINTS:
            del points[::2]


class TensorBoardExtras:
    """Writes the layout once and the power figure each epoch to every TensorBoard logger."""

    def __init__(self, writers: list) -> None:
        self.writers = writers
        self.layout_written = False

    @classmethod
    def for_trainer(cls, trainer) -> "TensorBoardExtras | None":
        from lightning.pytorch.loggers import TensorBoardLogger

        writers = [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        return cls(writers) if writers else None

    def after_epoch(self, trainer, epoch: int, power_points) -> None:
        if not self.layout_written:
            loss_tags = training_loss_tags(trainer.logged_metrics)
            for writer in self.writers:
                writer.add_custom_scalars(custom_scalars_layout(loss_tags))
            self.layout_written = True
        if power_points:
            figure = power_figure(power_points, epoch)
            for writer in self.writers:
                writer.add_figure("power/trace", figure, global_step=epoch, close=False)
            import matplotlib.pyplot as plt

            plt.close(figure)
        for writer in self.writers:
            writer.flush()


def training_loss_tags(logged_metrics) -> list[str]:
    """The module's training-loss metric names (anything with 'loss' not from validation or test)."""
    return sorted(k for k in logged_metrics if "loss" in k.lower() and not re.match(r"(val|valid|validation|test)\b|(val|test)[/_]", k))


def custom_scalars_layout(loss_tags: list[str]) -> dict:
    """Charts side by side: the training loss, energy per step, energy per epoch, power per step."""
    loss_regex = [re.escape(tag) for tag in loss_tags] or [r".*loss.*"]
    return {
        "lightning-energy": {
            "training loss": ["Multiline", loss_regex],
            "energy per step (J)": ["Multiline", [r"energy/step_J"]],
            "energy per epoch (J)": ["Multiline", [r"energy/epoch_J$", r"energy/val_epoch_J"]],
            "power per step (W)": ["Multiline", [r"power/step_W"]],
        }
    }


def power_figure(points, epoch: int):
    """Power of each sensor (W) over the epoch's seconds."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    t0 = points[0][0]
    names = sorted({name for _, powers in points for name in powers})
    figure, axes = plt.subplots(figsize=(7, 3.2))
    for name in names:
        xs = [t - t0 for t, p in points if name in p]
        ys = [p[name] for _, p in points if name in p]
        axes.plot(xs, ys, label=name, linewidth=1)
    axes.set_xlabel("seconds since epoch start")
    axes.set_ylabel("power (W)")
    axes.set_title(f"epoch {epoch} power")
    axes.legend(loc="best", fontsize="small")
    figure.tight_layout()
    return figure
