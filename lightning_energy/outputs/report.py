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
                sensor["note"] = ("an estimated share of a card counted whole by another sensor: listed, not summed"
                                  if "split" in sensor else
                                  "the same card as a lower rank's sensor (by UUID): counted there, not here")


def node_section(rank_summaries: list[dict], epochs: list[dict]) -> dict | None:
    """The report's ``node`` entry (None without node sensors): per host, the node's energy (its first node
    sensor covering the run; others are listed as cross-checks), the sum of the counted component sensors of
    the ranks on it, and the rest (``other_J``), each with its provenance; then the sums over the hosts that
    have a node figure, and those that have none. Fills each epoch row's ``node_J`` and ``node_other_J`` (the
    training part; only when every host has its node figure for that epoch)."""
    from lightning_energy.core.node import OTHER_LABEL, node_split

    if not any(summary.get("node_sensors") for summary in rank_summaries):
        return None
    hosts = list(dict.fromkeys(summary.get("node", "?") for summary in rank_summaries))
    entries = []
    for host in hosts:
        here = [summary for summary in rank_summaries if summary.get("node", "?") == host]
        components = [s for summary in here for s in summary["sensors"] if s.get("counted", True)]
        node_sensors = [s for summary in here for s in summary.get("node_sensors", [])]
        primary = next((s for s in node_sensors if s.get("energy_J") is not None and s.get("covers_run")),
                       next((s for s in node_sensors if s.get("energy_J") is not None), None))
        split = node_split(primary["energy_J"] if primary else None, of_entry(primary) if primary else MEASURED,
                           sum(s["energy_J"] for s in components), combine(of_entry(s) for s in components))
        entries.append({"host": host, **split, "node_sensor": primary["name"] if primary else None,
                        "node_bound_J": primary.get("bound_J") if primary else None,
                        "node_covers_run": bool(primary and primary.get("covers_run")),
                        "sensors": node_sensors})
    covered = [e for e in entries if e["node_J"] is not None]
    totals = node_split(sum(e["node_J"] for e in covered) if covered else None,
                        combine(e["node_provenance"] for e in covered),
                        sum(e["components_J"] for e in covered), combine(e["components_provenance"] for e in covered))
    for row in epochs:
        per_host = []
        for host in hosts:
            value = None
            for summary in rank_summaries:
                figures = summary.get("node_epochs", {}).get(str(row.get("epoch")))
                if summary.get("node", "?") != host or not figures:
                    continue
                names = [s["name"] for s in summary.get("node_sensors", [])]
                value = next((figures["energy_J"][n] for n in names
                              if n in figures["energy_J"] and n not in figures["missing"]), None)
                if value is not None:
                    break
            per_host.append(value)
        if per_host and all(v is not None for v in per_host):
            row["node_J"] = sum(per_host)
            row["node_other_J"] = row["node_J"] - row["train_J"]
    return {"label": OTHER_LABEL, **totals, "hosts": entries,
            "hosts_without_node_figure": [e["host"] for e in entries if e["node_J"] is None]}


def _summed_bound(sensors: list[dict]) -> float | None:
    """The sum of ``sensors``' ``bound_J`` (J); None when one is unknown."""
    bounds = [s.get("bound_J") for s in sensors]
    return None if any(b is None for b in bounds) else float(sum(bounds))


def build_report(rank_summaries: list[dict], epochs: list[dict], extra: dict) -> dict:
    """One report from every rank's summary (see ``EnergyCallback._rank_summary``).

    A sensor reading a card a lower rank reads too is listed (``counted: False``) but not summed. A summary's
    ``train_J`` and ``validation_J`` are all-rank figures (the same on every rank): taken from the first.
    Node sensors (scope ``"node"``, a summary's ``node_sensors``) are never in ``sensors`` nor the totals
    (they contain the components): the ``node`` entry (:func:`node_section`) holds them.
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
        # the attribution bound of total_J over this run (J; its resumed earlier part not included): how far the
        # samples leave open where the fit's start and end fall; None when a sensor's is unknown (failed)
        "bound_J": _summed_bound(counted),
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
        "node": node_section(rank_summaries, epochs),
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
    for sensor in report["sensors"]:
        shared = sensor.get("shared") or {}
        if shared.get("shared"):
            lines.append(f"note: sensor {sensor['name']} (rank {sensor['rank']}) reads a card shared with up to "
                         f"{shared.get('other_processes_max', '?')} other process(es): its energy includes theirs")
    figures = report.get("power_figures")
    if isinstance(figures, dict) and "drawn" in figures:
        lines.append(f"power figures in TensorBoard: {figures['drawn']} of {figures.get('epochs', '?')} epoch(s) "
                     f"({figures.get('rule', 'rule not recorded')})")
    lines.extend(_node_lines(report.get("node")))
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


def _joules(value: float, provenance: str) -> str:
    return tagged(f"{value:.1f} J", provenance)


def _node_lines(node: dict | None) -> list[str]:
    """The console lines of the report's ``node`` entry: per host, node = components + other, labelled."""
    if not isinstance(node, dict):
        return []
    lines = []
    for host in node.get("hosts", []):
        name = host["host"]
        for sensor in host.get("sensors", []):
            if sensor.get("failure"):
                since = sensor.get("missing_from_s") or 0.0
                lines.append(f"note: node sensor {sensor['name']} on {name} failed: {sensor['failure']}; its figures "
                             f"are missing from {since:.2f} s after fit start (energy up to then is kept)")
        if host.get("node_J") is None:
            lines.append(f"node {name}: no node figure (its node sensor did not cover the run: see notes)")
            continue
        bound = host.get("node_bound_J")
        lines.append(
            f"node {name}: {_joules(host['node_J'], host['node_provenance'])} from {host['node_sensor']}"
            + (f" (bound {bound:.1f} J)" if bound is not None else "")
            + f" = components {_joules(host['components_J'], host['components_provenance'])}"
            + f" + other {_joules(host['other_J'], host['other_provenance'])}"
            + ("" if host.get("node_covers_run") else " [the node figure is extrapolated or cut short: see its sensor]"))
        if host["other_J"] < 0:
            lines.append(f"note: on {name} the component sensors sum to more than the node's reading: a lagging or "
                         "partial node reading, or an estimate that is too high")
    if len(node.get("hosts", [])) > 1 and node.get("node_J") is not None:
        lines.append(f"nodes: {_joules(node['node_J'], node['node_provenance'])} = components "
                     f"{_joules(node['components_J'], node['components_provenance'])} + other "
                     f"{_joules(node['other_J'], node['other_provenance'])}")
    if node.get("hosts_without_node_figure"):
        lines.append(f"note: no node figure for {', '.join(node['hosts_without_node_figure'])}: the node totals "
                     "cover the other hosts only")
    lines.append(f"({node.get('label', '')})")
    return lines
