"""``lightning-energy sweep --config configs/sweep_*.yaml``: precision x batch size x power limit x repetitions.

Each run is a normal Lightning fit with EnergyCallback (its log dir under ``OUTPUT_DIR/runs/``), recorded
in ``OUTPUT_DIR/energy_catalog.sqlite``. Prints the results table with the CERN study's estimate
(energy per batch over 10 batches x batches) beside the measured energy, and writes
``sweep_results.json`` and ``sweep_results.csv`` into the output dir. The config's keys:
:mod:`lightning_energy.sweep.config`; power limits (:mod:`lightning_energy.sweep.runner`): on the simulated GPU (``sensors: {simulated: ...}``) or set on the real NVIDIA GPUs
(``sensors: auto``; checked before the first run, the default restored after each).
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from lightning_energy.cli.commands.common import table

HELP = "run a grid of fits (precision x batch size x power limit x repetitions) and tabulate energy"
RESULTS_JSON = "sweep_results.json"
RESULTS_CSV = "sweep_results.csv"


def add_arguments(parser) -> None:
    parser.add_argument("--config", type=Path, required=True, help="sweep YAML, e.g. configs/sweep_tiny.yaml")
    parser.add_argument("--output-dir", type=Path, default=None, help="overrides the config's output_dir")
    parser.add_argument("--dry-run", action="store_true", help="print the run order and stop")


def run(args) -> int:
    from lightning_energy.cli.commands import CommandError
    from lightning_energy.io import atomic_write_json, atomic_write_text
    from lightning_energy.provenance import MEASURED, combine, word
    from lightning_energy.sweep.config import SweepConfigError, load_config
    from lightning_energy.sweep.runner import SweepError, run_name, run_sweep, summarise, sweep_order

    try:
        config = load_config(args.config)
    except SweepConfigError as err:
        raise CommandError(f"{args.config}: {err}") from None
    if args.output_dir is not None:
        config.output_dir = args.output_dir
    order = sweep_order(config.points(), config.repetitions, config.seed)
    if args.dry_run:
        for index, (repetition, point) in enumerate(order):
            print(f"{index:>3}  {run_name(repetition, point)}")
        return 0
    try:
        rows = run_sweep(config, order)
    except SweepError as err:
        raise CommandError(str(err)) from None
    summary = summarise(rows)
    print(table(["#", "rep", "precision", "batch", "limit W*", "batches", "time s", "s/step", "energy J", "energy is",
                 "dev J/step", "train J", "CERN est J", "est/train", "EDP J*s", "gCO2e"],
                [[r["order"], r["repetition"], r["precision"], r["batch_size"], r["power_limit_W"], r["batches"],
                  r["duration_s"], r["time_per_step_s"], r["energy_J"], word(r["provenance"]), r["device_J_per_step"],
                  r["train_J"], r["cern_estimate_J"], r["cern_vs_train"], r["edp_Js"], r["gCO2e"]] for r in rows]))
    print()
    print(table(["precision", "batch", "limit W*", "runs", "time s", "± std", "energy J", "± std", "EDP J*s"],
                [[s["precision"], s["batch_size"], s["power_limit_W"], s["runs"], s["duration_s_mean"],
                  s["duration_s_std"], s["energy_J_mean"], s["energy_J_std"], s["edp_Js_mean"]] for s in summary]))
    notes = [f"CERN est: mean energy of {config.cern_batches} training batches x batches trained (steps only; "
             "train J is the training energy including data loading)"]
    notes.append("s/step, dev J/step: training time and device energy per step (between the steps included)")
    if config.power_limits == "simulated":
        gpu = config.simulated["gpu"]
        notes.append(f"* power limits are SIMULATED on lightning_energy.simulate.gpu_sim's GPU ({gpu['workload']} workload, "
                     f"limits {gpu['min_limit_W']}-{gpu['max_limit_W']} W): steps slow down below the draw the "
                     "workload asks for; the model's own figures are model_time_per_step_s and "
                     f"model_device_J_per_step in {RESULTS_JSON}")
    elif config.power_limits == "real":
        notes.append("* power limits were set on this machine's NVIDIA GPU(s) through Zeus; the default limit was "
                     "restored after each run")
    how = combine(r["provenance"] for r in rows)
    if how != MEASURED:
        notes.append(f"energies are {word(how)}: " + "; ".join(
            text for kind, text in (("estimated", "ESTIMATED sensors model power from TDP and load (no power sensor)"),
                                    ("simulated", "SIMULATED sensors follow a programmed trace or the simulated GPU"))
            if kind in how.split("+")))
    print("\n".join(notes))
    document = {"name": config.name, "config": str(args.config), "seed": config.seed, "repetitions": config.repetitions,
                "runs": rows, "summary": summary, "notes": notes}
    print(f"wrote {atomic_write_json(config.output_dir / RESULTS_JSON, document)}")
    print(f"wrote {atomic_write_text(config.output_dir / RESULTS_CSV, _csv(rows))}")
    return 0


def _csv(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in columns})
    return out.getvalue()
