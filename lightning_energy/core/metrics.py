"""The names and values every front end logs: one table, so a Trainer fit, a Fabric loop and a plain loop
show the same cards. Units are in the names (``_J``, ``_W``, ``_s``, ``_Js``); no name is a path prefix of
another; the public contract:

- ``energy/step_J``, ``power/step_W``, ``time/step_s``: one optimizer step (with gradient accumulation:
  all its micro-batches), this rank's sensors plus host sensors on local rank 0, at the steps the front end
  logs (a Trainer: where Lightning logs the loss, ``log_every_n_steps``, and the last step). Work other
  components add inside a step is left out and logged apart: ``energy/extra/<name>_J``, ``time/extra/<name>_s``.
- ``energy/total_J``: energy of all ranks since the first fit started, continuing across resumes and across
  ``fit`` calls on one Trainer; at every epoch end, (single process only) also at the step-level logging
  steps, and at the end of the run the report's total (so the last value logged is the run's total that
  every output shows). In a distributed run the step-level figure would need a collective per step, so:
- ``energy/rank0_total_J`` (distributed only, step level): rank 0's sensors alone since this fit started.
- ``energy/epoch_J``, ``power/epoch_W``, ``time/epoch_s``, ``edp/epoch_Js`` (energy x time): one training
  epoch without its validation, all ranks over one common interval (power: the sum of the sensors' powers).
- ``energy/sensor/<sensor name>/epoch_J``: the same per sensor, when there are several.
- ``energy/epoch_between_steps_J``: the epoch's energy outside the steps (data loading, hooks).
- ``energy/val_epoch_J``, ``power/val_epoch_W``, ``time/val_epoch_s``; ``energy/test_epoch_J``, ...;
  ``energy/predict_J``, ``power/predict_W``, ``time/predict_s``: validation, test and predict loops.
- with a node sensor (scope ``"node"``: Redfish, IPMI DCMI), on a single-node run: ``energy/node/epoch_J``,
  ``power/node/epoch_W`` (the whole node over the epoch's training part) and ``energy/other/epoch_J`` (the node
  less ``energy/epoch_J``: fans, PSU losses, disks, NICs), logged at the epoch's step once the BMC's samples
  cover the epoch (usually while the next epoch runs); multi-node runs have them in the report only.
- with telemetry on (:mod:`lightning_energy.core.telemetry`): ``telemetry/<sensor>/step/<field>`` and
  ``telemetry/<sensor>/epoch/<field>``.
"""

from __future__ import annotations

import re

from lightning_energy.core.figures import LoopFigures, StepFigures

LOOP_METRICS = {  # loop kind -> (energy, time, power) metric names
    "val": ("energy/val_epoch_J", "time/val_epoch_s", "power/val_epoch_W"),
    "test": ("energy/test_epoch_J", "time/test_epoch_s", "power/test_epoch_W"),
    "predict": ("energy/predict_J", "time/predict_s", "power/predict_W"),
}


def sensor_metric(sensor_name: str) -> str:
    """The per-sensor epoch metric: ``energy/sensor/<name>/epoch_J`` (characters loggers reject become ``_``)."""
    return f"energy/sensor/{re.sub(r'[^A-Za-z0-9_.-]', '_', sensor_name)}/epoch_J"


def _power(energy_J: float, duration_s: float) -> float:
    return energy_J / duration_s if duration_s > 0 else 0.0


def step_metrics(figures: StepFigures, names: list[str], running_J: float, total_key: str) -> dict[str, float]:
    """One step's metrics over the sensors ``names``: ``energy/step_J``, ``power/step_W``, ``time/step_s``,
    the running total under ``total_key`` (``energy/total_J``, or ``energy/rank0_total_J`` in a distributed
    run) and each sub-window other components added (``energy/extra/<name>_J``, ``time/extra/<name>_s``)."""
    m = figures.measurement
    energy_J = sum(m.energy_J.get(n, 0.0) for n in names)
    metrics = {"energy/step_J": energy_J, "power/step_W": _power(energy_J, m.duration_s),
               "time/step_s": m.duration_s, total_key: running_J}
    for name, extra in figures.extras.items():
        metrics[f"energy/extra/{name}_J"] = sum(extra.energy_J.get(n, 0.0) for n in names)
        metrics[f"time/extra/{name}_s"] = extra.duration_s
    return metrics


def loop_metrics(figures: LoopFigures) -> dict[str, float]:
    """A validation / test / predict loop's energy, time and power (all ranks)."""
    energy_name, time_name, power_name = LOOP_METRICS[figures.kind]
    return {energy_name: figures.total_J, time_name: figures.duration_s,
            power_name: _power(figures.total_J, figures.duration_s)}


def epoch_metrics(row: dict) -> dict[str, float]:
    """A training epoch's metrics from its report row (:func:`lightning_energy.core.recorder.epoch_row`), with
    ``energy/sensor/<name>/epoch_J`` for each sensor when there are several (with one it would repeat
    ``energy/epoch_J`` as a second, identical card)."""
    metrics = {
        "energy/epoch_J": row["train_J"],
        "power/epoch_W": row["power_W"],
        "time/epoch_s": row["train_s"],
        "edp/epoch_Js": row["edp_Js"],
        "energy/epoch_between_steps_J": row["between_steps_J"],
        "energy/total_J": row["total_J"],
    }
    if len(row["per_sensor_J"]) > 1:
        metrics.update({sensor_metric(name): joules for name, joules in sorted(row["per_sensor_J"].items())})
    if "zeus_J" in row:
        metrics["energy/zeus_epoch_J"] = row["zeus_J"]
    return metrics


def node_epoch_metrics(node_J: float, components_J: float, duration_s: float) -> dict[str, float]:
    """A training epoch's whole-node metrics: the node's energy and mean power, and the rest (the node less
    the component sensors' ``energy/epoch_J``)."""
    return {"energy/node/epoch_J": node_J, "power/node/epoch_W": _power(node_J, duration_s),
            "energy/other/epoch_J": node_J - components_J}
