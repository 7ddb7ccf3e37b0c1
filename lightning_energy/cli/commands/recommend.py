"""``lightning-energy recommend --config CFG.yaml --target val/loss=0.01``: the cheapest measured way to a target.

Searches the suite's levers (precision, dtype, batch size, learning rate and schedule, shuffling,
``torch.compile``, GPU power limits) one at a time from the config, combines the winners, then moves from the
best one lever at a time (``--refine-rounds``; :mod:`lightning_energy.optimize.recommend`), each run a ``fit`` of
the user's LightningCLI in its own process (:mod:`lightning_energy.optimize.recommend_config`) stopped at the
target, or early once it has spent ``--beta`` x the best energy to target. Writes into ``--out``:
``runs/<run>/`` (each run's config, log and logs), ``energy_catalog.sqlite`` (every run), ``recommend.json`` (every
run and configuration) and ``recommended.yaml`` (``CLI fit --config recommended.yaml`` trains the winner and stops
at the target).

``--test-data FILE`` adds the held-out check after the search
(:func:`~lightning_energy.optimize.recommend.heldout_check`): the config as given (its own ``max_epochs``, no
stop) and the pick (stopped at the target) trained again with each of ``--test-seeds``, then each model's
``--test-metric`` on FILE, which no run of the search reads (the config's data file is pointed at it in the test
runs only). Both test losses (median ± half range over the seeds), their energies and CPU times and the verdict
go into the table printed and ``recommend.json`` (``heldout``).
"""

from __future__ import annotations

import math
from pathlib import Path

from lightning_energy.cli.commands.common import table

HELP = "find the configuration that reaches a target metric for the least energy (measured)"
RESULTS_JSON = "recommend.json"
RECOMMENDED_YAML = "recommended.yaml"


def add_arguments(parser) -> None:
    parser.add_argument("--config", type=Path, action="append", required=True,
                        help="LightningCLI config (repeat to compose, as the CLI does)")
    parser.add_argument("--target", required=True, help="METRIC=VALUE (a loss), METRIC<=VALUE or METRIC>=VALUE")
    parser.add_argument("--cli", default=None, metavar="MODULE",
                        help="the LightningCLI module run as `python -m MODULE fit` (e.g. baler_lit.cli); default: "
                             "a plain LightningCLI for configs whose model has class_path")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each confirmed configuration: the baseline and the winners (default 2)")
    parser.add_argument("--screen-repeats", type=int, default=1,
                        help="runs of each configuration while screening one lever at a time (default 1)")
    parser.add_argument("--budget-runs", type=int, default=None, metavar="N", help="at most N runs in all")
    parser.add_argument("--refine-rounds", type=int, default=None, metavar="N",
                        help="rounds of coordinate descent from the best configuration: one lever moved at a time "
                             "(batch x2 or /2, learning rate x3 or /3, the others' values); default 2, 0 for none")
    parser.add_argument("--beta", type=float, default=None,
                        help="stop a run past beta x the best energy to target (default 2, Zeus's rule)")
    parser.add_argument("--levers", default=None, help="comma-separated levers to explore (default: all available)")
    parser.add_argument("--max-epochs", type=int, default=None, help="overrides trainer.max_epochs for every run")
    parser.add_argument("--power-limits", default=None, metavar="W,W", help="GPU power limits to try (NVIDIA only)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random run order")
    parser.add_argument("--run-timeout-s", type=float, default=None, help="kill a run after this many seconds")
    parser.add_argument("--out", type=Path, default=Path("runs/recommend"), help="output folder")
    parser.add_argument("--test-data", type=Path, default=None, metavar="FILE",
                        help="held-out rows no run of the search reads: after the search, the config as given and "
                             "the pick are trained again with fresh seeds and both models tested on FILE (the "
                             "config's data file, e.g. data.path, pointed at FILE in the test runs only)")
    parser.add_argument("--test-seeds", default=None, metavar="N,N",
                        help="seed_everything values of the held-out check (default 1,2,3; never the config's own)")
    parser.add_argument("--test-metric", default=None, metavar="METRIC",
                        help="the test run's metric compared (default: the target's, val -> test: test/loss)")
    parser.add_argument("--dry-run", action="store_true", help="print the levers and the most runs, and stop")


def run(args) -> int:
    from lightning_energy.cli.commands import CommandError
    from lightning_energy.extras import check_installed
    from lightning_energy.optimize.recommend import (
        DEFAULT_BETA, DEFAULT_REFINE_ROUNDS, DEFAULT_REPEATS, most_runs, parse_target, select_levers,
    )
    from lightning_energy.optimize.recommend_config import DEFAULT_CLI, ConfigError, has_compile, load_configs, set_path

    try:
        target = parse_target(args.target)
    except ValueError as err:
        raise CommandError(str(err)) from None
    repeats = DEFAULT_REPEATS if args.repeats is None else args.repeats
    beta = DEFAULT_BETA if args.beta is None else args.beta
    refine = DEFAULT_REFINE_ROUNDS if args.refine_rounds is None else args.refine_rounds
    for name, value, low in (("--repeats", repeats, 1), ("--budget-runs", args.budget_runs, 1),
                             ("--refine-rounds", refine, 0),
                             ("--max-epochs", args.max_epochs, 1), ("--screen-repeats", args.screen_repeats, 1)):
        if value is not None and value < low:
            raise CommandError(f"{name} must be >= {low}, got {value}")
    screen = min(args.screen_repeats, repeats)
    if not (math.isfinite(beta) and beta > 1):
        raise CommandError(f"--beta must be a number > 1, got {beta}")
    limits = _power_limits(args.power_limits)
    try:
        base = load_configs(args.config)
    except ConfigError as err:
        raise CommandError(str(err)) from None
    model = base.get("model")
    if args.cli is None and not (isinstance(model, dict) and "class_path" in model):
        raise CommandError("the config's model has no class_path, so the plain LightningCLI cannot build it: give "
                           "the LightningCLI module that reads this config with --cli (e.g. --cli baler_lit.cli)")
    heldout = _heldout_settings(args, base, target)
    defaults_max_epochs = (base.get("trainer") or {}).get("max_epochs") if isinstance(base.get("trainer"), dict) \
        else None
    if args.max_epochs is not None:
        set_path(base, "trainer.max_epochs", args.max_epochs)
    device = _device(base)
    levers, notes = _levers(base, device, limits, has_compile(base))
    try:
        levers = select_levers(levers, args.levers.split(",") if args.levers else None)
    except ValueError as err:
        raise CommandError(str(err)) from None
    if not args.dry_run:  # before anything is printed: what the runs will need
        check_installed(["jsonargparse", *(["zeus"] if limits else [])],
                        "its runs (LightningCLI fits; --power-limits: Zeus)")
    alternatives = sum(len(lever.alternatives) for lever in levers)
    most = most_runs(levers, screen, repeats, refine)
    print(f"target {target}; device {device}; {len(levers)} levers, {alternatives} alternatives; "
          f"{screen} run(s) each screened, {repeats} confirmed, {refine} refinement round(s); at most {most} runs"
          + (f" (capped at {args.budget_runs})" if args.budget_runs else ""))
    if heldout is not None:
        print(f"held-out check on {args.test_data}: the config as given and the pick, seeds "
              f"{','.join(map(str, heldout['seeds']))}: {2 * len(heldout['seeds'])} more runs (each a fit and a "
              f"test of {heldout['metric']})")
    for lever in levers:
        print(f"  {lever.name:<13} {lever.baseline!s:>10} -> {', '.join(map(str, lever.alternatives))}  ({lever.what})")
    for note in notes:
        print(f"  note: {note}")
    if args.dry_run:
        return 0
    if args.out.exists() and any(args.out.iterdir()):
        raise CommandError(f"--out {args.out} is not empty; give a new folder")
    if heldout is not None:
        heldout["defaults_max_epochs"] = defaults_max_epochs
    args.refine_rounds = refine
    return _search(args, base, levers, notes, target, (screen, repeats), beta, limits, device,
                   args.cli or DEFAULT_CLI, heldout)


def _heldout_settings(args, base: dict, target) -> dict | None:
    """The held-out check's test overlay, seeds and metric from ``--test-*``, or None without ``--test-data``;
    CommandError (one line, exit 2) for anything unusable, before any run starts."""
    from lightning_energy.cli.commands import CommandError
    from lightning_energy.optimize.recommend import DEFAULT_HELDOUT_SEEDS, heldout_metric_for, parse_seeds
    from lightning_energy.optimize.recommend_config import ConfigError, heldout_overlay

    if args.test_data is None:
        for name, value in (("--test-seeds", args.test_seeds), ("--test-metric", args.test_metric)):
            if value is not None:
                raise CommandError(f"{name} needs --test-data FILE (the held-out rows to test on)")
        return None
    if not args.test_data.is_file():
        what = "is not a file" if args.test_data.exists() else "does not exist"
        raise CommandError(f"--test-data {args.test_data} {what}")
    search_seed = base.get("seed_everything")
    search_seed = search_seed if isinstance(search_seed, int) and not isinstance(search_seed, bool) else None
    try:
        overlay = heldout_overlay(base, args.test_data)
        seeds = parse_seeds(args.test_seeds or ",".join(map(str, DEFAULT_HELDOUT_SEEDS)), search_seed)
    except (ConfigError, ValueError) as err:
        raise CommandError(str(err)) from None
    metric = args.test_metric or heldout_metric_for(target.monitor)
    if not metric or not metric.strip():
        raise CommandError(f"--test-metric: {target.monitor} names no validation metric to map to its test "
                           "metric: give the test run's metric, e.g. --test-metric test/loss")
    return {"file": args.test_data, "overlay": overlay, "seeds": seeds, "metric": metric.strip()}


def _search(args, base, levers, notes, target, repeats, beta, limits, device, cli, heldout=None) -> int:
    screen, repeats = repeats
    from lightning_energy.cli.commands import CommandError
    from lightning_energy.io import atomic_write_json, atomic_write_text
    from lightning_energy.optimize.recommend import Search, SearchError
    from lightning_energy.optimize.recommend_config import ConfigRunner, recommended_yaml

    by_name = {lever.name: lever for lever in levers}
    power = _open_power_limits(base, limits) if limits and device == "cuda" else None
    runner = ConfigRunner(base, by_name, target, args.out, cli, args.run_timeout_s, power)
    search = Search(levers, runner, repeats, beta, args.budget_runs, args.seed, log=print, target=target,
                    screen_repeats=screen, refine_rounds=args.refine_rounds)
    try:
        result = search.run()
    except SearchError as err:
        raise CommandError(str(err)) from None
    finally:
        if power is not None:
            power.close()
    rows = result.rows()
    print()
    print(format_table(rows))
    effects = result.lever_effects()
    if effects:
        print()
        print(format_effects(effects))
    summary = summary_lines(result, beta)
    print("\n".join(summary + [f"note: {n}" for n in notes]))
    check = _run_heldout(args, base, by_name, target, cli, result, heldout) if heldout is not None else None
    header = [f"Recommended by `lightning-energy recommend` for {target}: {result.recommended.name}",
              f"energy to target {rows_by(rows, result.recommended.name)['energy_J']:.4g} J "
              f"({rows_by(rows, result.recommended.name)['provenance']}) against the baseline's "
              f"{rows_by(rows, 'baseline')['energy_J']:.4g} J; EnergyToAccuracy stops training at the target.",
              f"Run: python -m {cli} fit --config {RECOMMENDED_YAML}"]
    if check is not None:
        header.insert(2, heldout_line(check["verdict"], check["metric"]))
    text = recommended_yaml(base, by_name, result.recommended.settings, target, header)
    document = {"target": str(target), "monitor": target.monitor, "value": target.value, "mode": target.mode,
                "device": device, "repeats": repeats, "screen_repeats": screen, "beta": beta, "cli": cli,
                "refine_rounds": args.refine_rounds,
                "configs": [str(c) for c in args.config], "levers": [
                    {"name": lv.name, "path": lv.path, "baseline": lv.baseline, "alternatives": list(lv.alternatives),
                     "what": lv.what} for lv in levers],
                "recommended": {"config": result.recommended.name, "settings": result.recommended.settings},
                "winners": result.winners, "configurations": rows, "lever_effects": effects, "runs": result.runs,
                "skipped": result.skipped, "budget_exhausted": result.budget_exhausted, "order": result.order,
                "notes": summary + notes}
    if check is not None:
        document["heldout"] = {"test_data": str(heldout["file"]), "metric": check["metric"],
                               "seeds": heldout["seeds"], "defaults_max_epochs": heldout["defaults_max_epochs"],
                               **check["verdict"], "runs": check["runs"]}
    print(f"wrote {atomic_write_json(args.out / RESULTS_JSON, document)}")
    print(f"wrote {atomic_write_text(args.out / RECOMMENDED_YAML, text)}")
    return 0


def _run_heldout(args, base, by_name, target, cli, result, heldout) -> dict:
    """The held-out check after the search: both configurations trained with each seed and tested; prints its
    table and verdict line."""
    from lightning_energy.optimize.recommend import compare_heldout, heldout_check
    from lightning_energy.optimize.recommend_config import HeldOutConfigRunner

    runner = HeldOutConfigRunner(base, by_name, target, args.out / "heldout", heldout["overlay"], cli,
                                 heldout["metric"], args.run_timeout_s, heldout["defaults_max_epochs"])
    print()
    print(f"held-out check on {heldout['file']} (seeds {','.join(map(str, heldout['seeds']))}): the config as "
          f"given, all its epochs, and the pick ({result.recommended.name}), stopped at the target")
    runs = heldout_check(runner, result.recommended.settings, heldout["seeds"], order_seed=args.seed, log=print)
    verdict = compare_heldout(runs)
    print()
    print(format_heldout(verdict, heldout["metric"]))
    print(heldout_line(verdict, heldout["metric"]))
    return {"verdict": verdict, "metric": heldout["metric"], "runs": [vars(r) for r in runs]}


def _pm(spread: dict) -> tuple:
    return _blank(spread["median"]), _blank(spread["pm"])


def format_heldout(verdict: dict, metric: str) -> str:
    """The held-out check's two configurations: the test metric, energy (J), CPU time (s), wall time (s) and
    epochs of the fit, median ± half range over the seeds, with the provenance of the joules."""
    from lightning_energy.optimize.recommend import DEFAULTS, RECOMMENDED

    rows = []
    for config, label in ((DEFAULTS, "config as given"), (RECOMMENDED, "recommended")):
        part = verdict[config]
        rows.append([label, f"{part['complete']}/{part['runs']}", part["reached_target"], *_pm(part["test_loss"]),
                     *_pm(part["energy_J"]), *_pm(part["cpu_s"]), *_pm(part["time_s"]),
                     _blank(part["epochs"]["median"]), part["provenance"]])
    return table(["held out", "complete", "reached", metric, "±", "energy J", "±", "CPU s", "±", "time s", "±",
                  "epochs", "energy is"], rows)


def heldout_line(verdict: dict, metric: str) -> str:
    """One line: both test figures with their spread, the verdict, and the ratios of the medians."""
    from lightning_energy.optimize.recommend import DEFAULTS, RECOMMENDED

    d, p = verdict[DEFAULTS]["test_loss"], verdict[RECOMMENDED]["test_loss"]
    complete = all(verdict[c]["complete"] == verdict[c]["runs"] > 0 for c in (DEFAULTS, RECOMMENDED))
    if not complete:
        judged = "no verdict: a held-out run failed (see the table)"
    elif verdict["test_no_worse_strict"]:
        judged = "no worse than the config as given"
    elif verdict["test_no_worse"]:
        judged = "no worse within the config's seed-to-seed spread (above its median)"
    else:
        judged = "WORSE than the config as given (above its worst seed)"
    return (f"held out: {metric} {p['median']:.6g} ± {_num(p['pm'])} (recommended) vs {d['median']:.6g} ± "
            f"{_num(d['pm'])} (config as given): {judged}; {_num(verdict['energy_ratio'])} x less energy "
            f"({verdict[RECOMMENDED]['provenance']}), {_num(verdict['cpu_ratio'])} x less CPU time; median ± half "
            f"range over {verdict[DEFAULTS]['runs']} seeds")


def _num(value) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.3g}"


def rows_by(rows: list[dict], config: str) -> dict:
    return next(r for r in rows if r["config"] == config)


def _blank(value):
    """None (shown as ``-``) for a figure a configuration does not have (NaN: not reached, or one run only)."""
    return None if isinstance(value, float) and math.isnan(value) else value


def format_table(rows: list[dict]) -> str:
    """The configurations: energy, time and CO2 to target (median ± half range), provenance, status."""
    rows = [{k: _blank(v) for k, v in r.items()} for r in rows]
    return table(["config", "stage", "runs", "reached", "energy J", "±", "time s", "±", "gCO2e", "±", "epochs",
                  "x less J", "energy is", "status"],
                 [[r["config"], r["stage"], r["runs"], r["reached"], r["energy_J"], r["energy_J_pm"], r["time_s"],
                   r["time_s_pm"], r["gCO2e"], r["gCO2e_pm"], r["epochs"], r["energy_ratio"], r["provenance"],
                   r["status"]] for r in rows])


def format_effects(effects: list[dict]) -> str:
    """What each lever gave: x less energy alone against the baseline, and lost when left out of the winners."""
    return table(["lever", "value", "alone: x less J", "winner", "left out: x more J"],
                 [[e["lever"], str(e["value"]), e["alone_x"], "yes" if e["winner"] else "no",
                   f">= {e['in_combination_x']:.4g}" if e["in_combination_at_least"] else e["in_combination_x"]]
                  for e in effects])


def summary_lines(result, beta: float) -> list[str]:
    lines = [f"recommended: {result.recommended.name} ({result.runs} runs, {result.skipped} skipped; "
             f"runs stopped past {beta:g} x the best energy to target)"]
    if result.budget_exhausted:
        lines.append("the run budget (--budget-runs) ran out before the search finished")
    lines.append("energy to target: from the fit's start to the end of the validation run that reached it "
                 "(process start-up and imports not included); ± is half the range over the repeats")
    return lines


def _power_limits(text: str | None) -> list[float] | None:
    from lightning_energy.cli.commands import CommandError

    if text is None:
        return None
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CommandError(f"--power-limits {text!r}: expected watts separated by commas, e.g. 200,250") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise CommandError(f"--power-limits {text!r}: expected watts > 0 separated by commas")
    return values


def _device(config: dict) -> str:
    """``"cuda"`` when the runs will train on an NVIDIA GPU, else ``"cpu"``."""
    trainer = config.get("trainer") if isinstance(config.get("trainer"), dict) else {}
    if str(trainer.get("accelerator", "auto")) not in ("auto", "gpu", "cuda"):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _levers(base, device, limits, compile_in_config):
    from lightning_energy.optimize.recommend import find_levers

    return find_levers(base, device, limits, compile_in_config)


def _open_power_limits(base: dict, limits: list[float]):
    from lightning_energy.cli.commands import CommandError
    from lightning_energy.sweep.runner import GpuPowerLimits, SweepError

    try:
        return GpuPowerLimits.open(base.get("trainer") or {}, limits)
    except SweepError as err:
        raise CommandError(str(err)) from None
