"""PrometheusCallback: a Trainer run's energy for Prometheus, served on each node and pushed to a Pushgateway."""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from lightning_energy.integration.base import MeteredCallback
from lightning_energy.outputs.prometheus import DEFAULT_ADDRESS, DEFAULT_JOB, DEFAULT_PUSH_TIMEOUT_S, PrometheusExporter


class PrometheusCallback(MeteredCallback):
    """Export the fit's energy to Prometheus: ``Trainer(callbacks=[EnergyCallback(), PrometheusCallback(port=9464)])``.

    The Trainer front end of :class:`~lightning_energy.outputs.prometheus.PrometheusExporter` (its docstring
    lists the series and when they move): local rank 0 of each node serves its node's ranks on ``port``, and
    with ``pushgateway`` global rank 0 pushes every rank's series at each epoch end and at the fit's end. It
    reads the sensors of the Trainer's session (an ``EnergyCallback``'s, else auto-detected); at the fit's end
    ``sum(lightning_energy_joules_total{scope!="node"})`` is the report's ``total_J``. Nothing runs on the training thread but
    a reference kept per step and a push queued per epoch (under DDP also one small all-gather per epoch end).

    The endpoint keeps serving the final values after the fit, until ``callback.exporter.close()`` or the
    process ends. Args as ``PrometheusExporter``'s.
    """

    def __init__(self, port: int | None = None, pushgateway: str | None = None, *, address: str = DEFAULT_ADDRESS,
                 job: str = DEFAULT_JOB, grouping_key: dict[str, str] | None = None,
                 push_timeout_s: float = DEFAULT_PUSH_TIMEOUT_S) -> None:
        super().__init__()
        self.exporter = PrometheusExporter(port, pushgateway, address=address, job=job, grouping_key=grouping_key,
                                           push_timeout_s=push_timeout_s)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.attachment is None:
            self.exporter.attach(self.attach(trainer))

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.exporter.run_ended()  # the timeline placed the fit's end (and delivered every figure) before this

    @override
    def release(self, trainer: Trainer, stage: str | None, exception: BaseException | None) -> None:
        self.exporter.detach()
