"""Energy to target: Baler's defaults against ``lightning-energy recommend``'s pick, to the same loss.

    python benchmarks/energy_to_target.py            # both datasets (about 15 min on one quiet core)
    python benchmarks/energy_to_target.py --datasets nanoaod --repeats 3

For each dataset:

1. **Baler's defaults** (``configs/cms_ae.yaml`` + ``configs/baler_parity.yaml``: float64, batch 512, no
   shuffling, Adam 1e-3, Baler's loss Σ(x̂−x)²/n_columns, ReduceLROnPlateau patience 50) with one change:
   a 20 % validation split (Baler's ``test_size`` 0 has no held-out loss to set a target on), trained for a
   fixed budget of epochs (``BUDGET_EPOCHS``). The validation loss it ends at is the **target**, and that
   run's energy is what the defaults cost for the budget.
2. ``lightning-energy recommend`` from the same config to that target (``val/loss<=target``), screening
   every lever once and confirming the baseline and the winners with ``--repeats`` runs each; its runs
   may train up to twice the budget of epochs (the energy budgets stop those that cannot win).
3. The ratios: the defaults' median energy (and time) to the target over the recommended
   configuration's, both measured in the same search; which lever gave what (alone against the
   defaults, and left out of the winning combination).

Energies on a machine without RAPL access are the CPU estimate (TDP × load): labelled ``estimated``.
Every run is its own process (start-up and imports are not part of the energy to target). The JSON
goes to ``benchmarks/results/energy_to_target.json``; the search folders to ``--work`` (default a
temporary folder, kept for ``lightning-energy compare``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import machine_info, write_json_atomic  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
if not DATA.is_dir():
    DATA = Path("/work/shared/data")
RESULTS = ROOT / "benchmarks" / "results" / "energy_to_target.json"
DATASETS = {
    # name: (data overrides, fixed budget of epochs for the defaults)
    "synthetic": ({"path": None, "synthetic_rows": 10_000}, 20),
    "nanoaod": ({"path": str(DATA / "nanoAOD_2015_CMS_Open_Data_ttbar.root"), "root_prefix": "Jet_"}, 100),
}
CLI = "baler_lit.cli"
SEARCH_EPOCHS_FACTOR = 2  # the search's runs may train up to 2x the defaults' budget of epochs


def overlay(data: dict, epochs: int) -> dict:
    return {"trainer": {"max_epochs": epochs, "logger": False, "enable_progress_bar": False,
                        "enable_model_summary": False},
            "data": {**data, "val_fraction": 0.2}}


def calibrate(base: dict, out: Path, reuse: bool) -> dict:
    """The defaults for the fixed budget, no stop: the val/loss they end at (the target) and their cost."""
    from lightning_energy.optimize.recommend import Target
    from lightning_energy.optimize.recommend_config import ConfigRunner

    runner = ConfigRunner(base, {}, Target("val/loss", 0.0, "min"), out, CLI)  # a target no run reaches
    record = runner._record("defaults_fixed_budget") if reuse else None
    if record is None:
        outcome = runner({}, "defaults_fixed_budget", None)
        record = runner._record("defaults_fixed_budget")
        if record is None or "val/loss" not in record["metrics"]:
            raise SystemExit(f"the defaults' run failed: {outcome.stopped}")
    return {"val_loss": record["metrics"]["val/loss"], "energy_J": record["energy_J"],
            "time_s": record["duration_s"], "epochs": record["epochs"], "provenance": record["provenance"]}


def run_dataset(name: str, work: Path, repeats: int, budget_runs: int | None, reuse: bool = False) -> dict:
    import yaml

    from lightning_energy.cli.main import main as lightning_energy
    from lightning_energy.optimize.recommend_config import load_configs, merge

    data, epochs = DATASETS[name]
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    extra = folder / "benchmark_overlay.yaml"
    extra.write_text(yaml.safe_dump(overlay(data, epochs), sort_keys=False))
    configs = [ROOT / "configs" / "cms_ae.yaml", ROOT / "configs" / "baler_parity.yaml", extra]
    base = merge(load_configs(configs), {})
    started = time.perf_counter()
    fixed = calibrate(base, folder / "calibration", reuse)
    target = fixed["val_loss"]
    print(f"[{name}] Baler's defaults, {epochs} epochs: val/loss {target:.6g}, {fixed['energy_J']:.4g} J "
          f"({fixed['provenance']}), {fixed['time_s']:.3g} s", flush=True)
    # the search's runs may go past the defaults' budget (a configuration a little slower per epoch still
    # reaches the target, at its cost); the energy budgets stop the ones that cannot win
    argv = ["recommend", "--cli", CLI, "--target", f"val/loss<={target!r}", "--repeats", str(repeats),
            "--max-epochs", str(SEARCH_EPOCHS_FACTOR * epochs), "--out", str(folder / "recommend")]
    argv += [a for c in configs for a in ("--config", str(c))]
    if budget_runs:
        argv += ["--budget-runs", str(budget_runs)]
    if not (reuse and (folder / "recommend" / "recommend.json").is_file()):
        text = io.StringIO()
        with redirect_stdout(text):
            code = lightning_energy(argv)
        print(text.getvalue(), flush=True)
        if code != 0:
            raise SystemExit(f"[{name}] recommend failed with exit code {code}")
    result = json.loads((folder / "recommend" / "recommend.json").read_text())
    rows = {r["config"]: r for r in result["configurations"]}
    base_row, best = rows["baseline"], rows[result["recommended"]["config"]]
    return {
        "dataset": name, "data": data, "budget_epochs": epochs, "target_val_loss": target,
        "defaults_fixed_budget": fixed, "recommended": result["recommended"],
        "energy_ratio": base_row["energy_J"] / best["energy_J"],
        "energy_ratio_vs_fixed_budget": fixed["energy_J"] / best["energy_J"],
        "time_ratio": base_row["time_s"] / best["time_s"],
        "baseline": base_row, "best": best, "configurations": result["configurations"],
        "lever_effects": result["lever_effects"], "runs": result["runs"], "wall_s": time.perf_counter() - started,
    }


def summary_table(results: list[dict]) -> str:
    from lightning_energy.cli.commands.common import table

    return table(["dataset", "target val/loss", "defaults J", "± ", "best J", "±", "x less J", "defaults s",
                  "best s", "x less s", "energy is", "recommended"],
                 [[r["dataset"], r["target_val_loss"], r["baseline"]["energy_J"], r["baseline"]["energy_J_pm"],
                   r["best"]["energy_J"], r["best"]["energy_J_pm"], r["energy_ratio"], r["baseline"]["time_s"],
                   r["best"]["time_s"], r["time_ratio"], r["best"]["provenance"], r["recommended"]["config"]]
                  for r in results])


def effects_table(effects: list[dict]) -> str:
    from lightning_energy.cli.commands.recommend import format_effects

    return format_effects(effects)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", default="synthetic,nanoaod")
    parser.add_argument("--repeats", type=int, default=2, help="confirmation runs per configuration")
    parser.add_argument("--budget-runs", type=int, default=24, help="cap on the search's runs per dataset")
    parser.add_argument("--work", type=Path, default=None, help="folder for the runs (default: a new temp folder)")
    parser.add_argument("--reuse", action="store_true",
                        help="tabulate what --work already holds (a finished calibration or search is not rerun)")
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"JSON to write (default {RESULTS})")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="energy_to_target_"))
    results = [run_dataset(name, work, args.repeats, args.budget_runs, args.reuse)
               for name in args.datasets.split(",")]
    print(summary_table(results))
    for r in results:
        print(f"\n[{r['dataset']}] what each lever gave (x less energy to the target than the defaults):")
        print(effects_table(r["lever_effects"]))
    provenance = {r["best"]["provenance"] for r in results}
    print(f"energies are {'/'.join(sorted(provenance))}; ratios are of medians over {args.repeats} confirmed runs "
          f"each; goal: >= 5x less energy to the same target")
    write_json_atomic(args.results, {"machine": machine_info(omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                                                       load_average=os.getloadavg()),
                                "note": "measured on a shared machine (other jobs running): timings are disturbed",
                                "work": str(work), "repeats": args.repeats, "results": results})
    print(f"wrote {args.results}; runs in {work}")


if __name__ == "__main__":
    main()
