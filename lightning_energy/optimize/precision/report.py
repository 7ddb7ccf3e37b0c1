"""The end-of-fit precision report of ``PrecisionSwitch``: a per-mode table and the switch events."""

from __future__ import annotations

import time

from lightning_energy.optimize.precision.modes import MODE_NAMES, MODES, REFERENCE_MODE

REPORT_FILE = "precision_report.json"
KEPT_CHECKS = 200  # the most recent guard checks kept (in memory, checkpoints and the report)


def build_precision_report(
    *, fixed_mode: str | None, plan: list[str], tolerance: float, objective: str, chosen: str | None,
    decision: str | None, final_mode: str, phase: str, profiles: dict[str, dict], rejected: dict[str, str],
    trained_per_rank: list[dict[str, dict]], switches: list[dict], checks: list[dict], checks_total: int,
    skipped_steps: int, estimated: bool, nonfinite_losses: int = 0, probes_per_rank: list[dict] = (),
    confidence: float | None = None, profile_rounds: int = 0, probe_batches: int | None = None,
) -> dict:
    """The report as a JSON-ready dict. ``trained_per_rank``: per rank, mode -> steps, energy_J, seconds
    (the probes excluded); ``probes_per_rank``: per rank, the probes' steps, energy_J and seconds."""
    trained_modes = {name for rank in trained_per_rank for name in rank}
    rows = []
    for name in MODE_NAMES:
        if name not in plan and name not in trained_modes and name not in rejected:
            continue
        profile = profiles.get(name, {})
        parts = [rank[name] for rank in trained_per_rank if name in rank]
        status = profile.get("status") or rejected.get(name) or ("fixed" if name == fixed_mode else "")
        if name in rejected and not status.startswith(("rejected", "fell back", "unavailable")):
            status = rejected[name]
        rows.append({
            "mode": name,
            "code": MODES[name].code,
            "profiled_steps": profile.get("steps", 0),
            "step_J": profile.get("step_J"),
            "step_s": profile.get("step_s"),
            "step_J_se": profile.get("step_J_se"),
            "step_s_se": profile.get("step_s_se"),
            "profiled_rounds": profile.get("rounds", 0),
            "step_J_round_se": profile.get("step_J_round_se"),
            "step_s_round_se": profile.get("step_s_round_se"),
            "power_W": profile.get("power_W"),
            "loss_gap": profile.get("loss_gap"),
            "grad_error": profile.get("grad_error"),
            "grad_cosine": profile.get("grad_cosine"),
            "grad_norm_ratio": profile.get("grad_norm_ratio"),
            "grad_zero_share": profile.get("grad_zero_share"),
            "grad_nonfinite_share": profile.get("grad_nonfinite_share"),
            "mean_loss": profile.get("mean_loss"),
            "status": status,
            "trained_steps": max((p["steps"] for p in parts), default=0),
            "trained_J": sum(p["energy_J"] for p in parts),
            "trained_s": max((p["seconds"] for p in parts), default=0.0),
        })
    for row in rows:  # energy and time per step over the whole fit, profiling included
        n = row["trained_steps"]
        row["trained_step_J"] = row["trained_J"] / n if n else None
        row["trained_step_s"] = row["trained_s"] / n if n else None
    return {
        "created_unix_s": time.time(),
        "mode_legend": {name: MODES[name].code for name in MODE_NAMES},
        "fixed_mode": fixed_mode,
        "reference": REFERENCE_MODE,
        "candidates": list(plan),
        "tolerance": tolerance,
        "objective": objective,
        "confidence": confidence,
        "profile_rounds": profile_rounds,
        "probe_batches": probe_batches,
        "phase": phase,
        "chosen": chosen,
        "decision": decision,
        "final_mode": final_mode,
        "world_size": len(trained_per_rank),
        "energy_estimated": estimated,
        "skipped_steps": skipped_steps,
        "nonfinite_losses": nonfinite_losses,
        "modes": rows,
        "switches": list(switches),
        "checks": list(checks[-KEPT_CHECKS:]),
        "checks_total": checks_total,
        # the full-precision replays measuring the loss gap, apart from every step figure: steps that had
        # one, their energy (J, all ranks) and time (s, the slowest rank)
        "probe": {
            "steps": max((p["steps"] for p in probes_per_rank), default=0),
            "energy_J": sum(p["energy_J"] for p in probes_per_rank),
            "seconds": max((p["seconds"] for p in probes_per_rank), default=0.0),
        },
    }


def format_precision_report(report: dict) -> str:
    """The report as a console table."""
    label = "estimated" if report["energy_estimated"] else "measured"
    if report["fixed_mode"]:
        head = f"precision: fixed mode {report['fixed_mode']}; energy {label}"
    else:
        head = (f"precision switch: chosen {report['chosen'] or 'nothing (training ended while profiling)'}, "
                f"final {report['final_mode']}; tolerance {report['tolerance']:g}, objective "
                f"{report['objective']}; energy {label}")
    lines = [head]
    if report["decision"] and not report["fixed_mode"]:
        lines.append(f"  decision: {report['decision']}")
    columns = f"  {'mode':<17}{'code':>4}{'prof J/step':>20}{'prof s/step':>20}{'loss gap':>10}{'grad err':>10}" \
              f"{'steps':>8}{'trained J':>12}  status"
    lines.append(columns)
    for row in report["modes"]:  # mean +- standard error of the profiled steps
        lines.append(
            f"  {row['mode']:<17}{row['code']:>4}{_pm(row['step_J'], row.get('step_J_se')):>20}"
            f"{_pm(row['step_s'], row.get('step_s_se')):>20}"
            f"{_num(row['loss_gap']):>10}{_num(row.get('grad_error')):>10}{row['trained_steps']:>8}{_num(row['trained_J']):>12}  {row['status']}"
        )
    for event in report["switches"]:
        lines.append(f"  step {event['step']}: {event['from']} -> {event['to']} ({event['reason']})")
    probe = report.get("probe") or {}
    if probe.get("steps"):
        lines.append(f"  loss-gap probes (not in the figures above): {probe['steps']} steps, "
                     f"{_num(probe['energy_J'])} J, {_num(probe['seconds'])} s")
    if report.get("nonfinite_losses"):
        lines.append(f"  non-finite training losses: {report['nonfinite_losses']} (all ranks)")
    return "\n".join(lines)


def _num(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def _pm(value, se) -> str:
    """``mean +- se`` (the standard error left out when unknown)."""
    return _num(value) if value is None or se is None else f"{value:.4g} +- {se:.2g}"
