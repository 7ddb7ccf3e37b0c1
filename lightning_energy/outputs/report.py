"""The end-of-fit energy report: assembled from per-rank summaries, printed as a table, saved as JSON."""

from __future__ import annotations

import math
import platform
import time

from lightning_energy.filenames import REPORT_FILE  # noqa: F401  (the report file, named where it is built)
from lightning_energy.provenance import ESTIMATED, KINDS, MEASURED, SIMULATED, combine, of_entry, of_report, tagged
from lightning_energy.units import J_PER_KWH


def version() -> str:
    from importlib import metadata  # here: importing it costs ~0.1 s of every command's start-up

    try:
        return metadata.version("lightning-energy")
    except metadata.PackageNotFoundError:
        return "unknown"


def _count_each_card_once(rank_summaries: list[dict]) -> None:
    """Mark ``counted: False`` (with a note) each sensor of a rank's summary (in rank order) that reads a card a
    lower rank's sensor reads too (two ranks on one GPU, by its UUID): the report counts each card once."""
    from lightning_energy.measure.sensors.detect import duplicate_device_sensors

    skip = duplicate_device_sensors([summary["sensors"] for summary in rank_summaries])
    for rank, summary in enumerate(rank_summaries):
        for sensor in summary["sensors"]:
            if (rank, sensor["name"]) in skip:
                sensor["counted"] = False
                sensor["note"] = "the same card as a lower rank's sensor (by UUID): counted there, not here"


def build_report(rank_summaries: list[dict], epochs: list[dict], extra: dict) -> dict:
    """One report from every rank's summary (see ``EnergyCallback._rank_summary``).

    A sensor reading a card a lower rank reads too is listed (``counted: False``) but not summed. A summary's
    ``train_J`` and ``validation_J`` are all-rank figures (the same on every rank): taken from the first.
    """
    _count_each_card_once(rank_summaries)
    sensors = [s for summary in rank_summaries for s in summary["sensors"]]
    counted = [s for s in sensors if s.get("counted", True)]
    total_J = sum(s["energy_J"] for s in counted) + extra.get("resumed_total_J", 0.0)
    by_provenance = {kind: sum(s["energy_J"] for s in counted if of_entry(s) == kind) for kind in KINDS}
    duration_s = max((r["duration_s"] for r in rank_summaries), default=0.0) + extra.get("resumed_duration_s", 0.0)
    first = rank_summaries[0] if rank_summaries else {"train_J": 0.0, "validation_J": 0.0}
    train_J = first["train_J"] + extra.get("resumed_train_J", 0.0)
    validation_J = first["validation_J"] + extra.get("resumed_validation_J", 0.0)
    return {
        "tool": f"lightning-energy {version()}",
        "created_unix_s": time.time(),
        "host": platform.node(),
        "world_size": len(rank_summaries),
        "duration_s": duration_s,
        "total_J": total_J,
        "total_kWh": total_J / J_PER_KWH,
        "train_J": train_J,
        "validation_J": validation_J,
        "other_J": total_J - train_J - validation_J,
        # where the joules come from (lightning_energy.provenance); a resumed run's earlier part is in none
        "provenance": combine(of_entry(s) for s in sensors),
        "measured_J": by_provenance[MEASURED],
        "estimated_J": by_provenance[ESTIMATED],
        "simulated_J": by_provenance[SIMULATED],
        "estimated": any(s["estimated"] for s in sensors),
        "mean_power_W": total_J / duration_s if duration_s > 0 else math.nan,
        "edp_Js": total_J * duration_s,
        "sensors": sensors,
        "epochs": epochs,
        "ranks": rank_summaries,
        **{k: v for k, v in extra.items() if not k.startswith("resumed_")},
        "resumed": {k[len("resumed_"):]: v for k, v in extra.items() if k.startswith("resumed_")} or None,
    }


def format_report(report: dict) -> str:
    """The console table: one row per sensor and rank, then the totals; each figure says where it comes from.

    Where the report holds ``power_figures`` (``{"drawn": n, "epochs": m, "rule": "..."}``, from
    :meth:`~lightning_energy.outputs.tensorboard.TensorBoardExtras.figure_summary`), one line says how many
    epochs got a power figure in TensorBoard and by what rule.
    """
    header = f"{'sensor':<18} {'rank':>4} {'scope':<6} {'energy J':>12} {'mean W':>9}  {'how':<9} source"
    total = tagged(f"{report['total_J']:.1f} J = {report['total_kWh']:.3g} kWh", of_report(report))
    lines = [
        f"lightning-energy report: {report['duration_s']:.2f} s, {total}, {len(report['epochs'])} epoch(s), "
        f"world size {report['world_size']}",
        header,
        "-" * len(header),
    ]
    for s in report["sensors"]:
        how = "FAILED" if s.get("failure") else of_entry(s)
        lines.append(
            f"{s['name']:<18} {s['rank']:>4} {s['scope']:<6} {s['energy_J']:>12.2f} {s['mean_power_W']:>9.2f}  "
            f"{how:<9} {s['source']}"
        )
    lines.append("-" * len(header))
    lines.append(
        f"{'total':<18} {'':>4} {'':<6} {report['total_J']:>12.2f} {report['mean_power_W']:>9.2f}  "
        f"train {report['train_J']:.2f} J, validation {report['validation_J']:.2f} J, other {report['other_J']:.2f} J"
    )
    if report["estimated"]:
        lines.append(f"note: {report['estimated_J']:.2f} J of the total is an ESTIMATE, not a measurement (see source)")
    if report.get("simulated_J"):
        lines.append(f"note: {report['simulated_J']:.2f} J of the total is SIMULATED (a programmed power trace or a "
                     "simulated GPU), not a measurement")
    figures = report.get("power_figures")
    if isinstance(figures, dict) and "drawn" in figures:
        lines.append(f"power figures in TensorBoard: {figures['drawn']} of {figures.get('epochs', '?')} epoch(s) "
                     f"({figures.get('rule', 'rule not recorded')})")
    if report.get("sections"):
        lines.append(f"sections in the JSON report: {', '.join(sorted(report['sections']))}")
    for s in report["sensors"]:
        if s.get("failure"):
            since = s.get("missing_from_s")
            when = f"from {since:.2f} s after fit start" if since is not None else "from its failure"
            lines.append(f"note: sensor {s['name']} (rank {s['rank']}) failed: {s['failure']}; its figures are "
                         f"missing {when} (energy up to then is counted)")
    gaps = [str(e["epoch"]) for e in report["epochs"] if e.get("missing_sensors")]
    if gaps:
        lines.append(f"note: epoch(s) {', '.join(gaps)} lack some sensors' figures (see missing_sensors in the JSON)")
    return "\n".join(lines)
