"""Recommend: the configuration that reaches a target metric for the least energy, found by measuring.

``lightning-energy recommend --config CFG.yaml --target val/loss=0.01`` trains the user's LightningCLI
config with the suite's levers changed, measures each run's **energy to target** (J) and **time to
target** (s) with :class:`~lightning_energy.EnergyToAccuracy` (from the fit's start to the end of the
validation run that first reached the target; the run stops there), and recommends the cheapest.
This module is the search; :mod:`lightning_energy.optimize.recommend_config` builds each run's config and runs
it in its own process.

The levers (:func:`find_levers`; each only where the config has the key): precision
(``trainer.precision``: PrecisionSwitch's modes that run on the device), the model's parameter dtype
(``dtype: float64 -> float32``), batch size (÷4, ÷2, ×2), learning rate (×3, ×10, ×30), the learning-rate
schedule (a ReduceLROnPlateau ``lr_patience`` of 3 epochs), shuffling, ``torch.compile``
(:class:`~lightning_energy.CompileModel`) and, on NVIDIA GPUs, the power limits given. Early stopping at
the target is part of every run and of the recommendation.

**The search, and why it is cheap.** A full grid of 8 alternatives over 7 levers is hundreds of runs;
energy to target has no cheap low-fidelity proxy either (a high learning rate looks worse for a few
epochs and wins later, so successive halving on partial runs would cut the winners). So:

1. *Baseline*: the config as given, alone and uncapped: the reference.
2. *One lever at a time* (screening): each alternative value of each lever changed alone from the
   baseline, ``screen_repeats`` (S) runs each, with the baseline's, all the stage's runs in one random
   order, so a drift of a shared machine spreads over every configuration instead of lining up with one.
3. *Combine the winners* (confirmation): per lever, the best value whose every run beat every baseline
   run; all the winners together, that combination with each winner left out (which says what each
   lever adds in company: the ablation), the best single change (levers interact: a smaller batch may
   want nothing else) and the baseline, topped up to ``repeats`` (R) runs each, in rounds of one run
   per configuration in a new random order each round.
   With one winner, it and the baseline are topped up.
4. *Refine* (coordinate descent, up to ``refine_rounds`` rounds, 2 by default): the screened values are
   fixed steps from the *baseline*, but levers interact (a smaller batch wants a different rate; once the
   batch is ÷4, ÷8 may win again), so the search moves from the best confirmed configuration one lever at
   a time: each numeric lever one step either way (batch size ×2 or ÷2, at least 8 rows; learning rate ×3
   or ÷3), each other lever to its other values, ``screen_repeats`` runs each with the best's lowest energy
   to target as the budget (past it, it cannot beat the best). The cheapest candidate whose every run beat
   every run of the best is topped up to R runs beside the best and replaces it if its median is lower;
   a round with no such candidate ends the refinement.
5. *Recommend*: of the configurations with R runs that all reached the target, the lowest median
   energy to target.

Without refinement that is at most ``S·(1 + A) + R·(3 + W) - 2S`` runs (A alternatives, W winners): 21 for
A = 10, W = 3, S = 1, R = 2; each refinement round adds at most one run per neighbour (about 10 for Baler's
levers), each stopped at the best's energy, and R for the challenger; a full grid of the same levers would
be hundreds.

**Stopping bad configurations early.** Every run carries an energy budget, and
:class:`~lightning_energy.EnergyToAccuracy` ends it at the first validation past it without the target;
a run that does not reach the target within the config's ``max_epochs`` has lost too, and a
configuration that lost once gets no further repeats. While screening, the question is only whether an
alternative beats the baseline, and one that has spent the baseline's lowest energy to target without
reaching it cannot be a winner (a winner beats every baseline run): the budget is that energy, so a
lever that helps a little is not cut because another helps a lot. From then on it is **Zeus's rule**:
``beta`` (2) × the lowest energy to target finished so far; while refining, a candidate's budget is the best
configuration's lowest energy to target. The baseline never has a budget: it is the reference of every ratio.
``budget_runs`` caps the total number of runs.

Figures: medians over the repeats, ± half their range, CO2 to target from the catalog record's
intensity and PUE, and the provenance of every joule (measured / estimated / simulated).

**What the search does not show, and the held-out check that does.** The target, the stopping rule, the
screening, the pick and the search's energies all read one validation split, and the pick's energies are
the best of several configurations measured on it (a winner's figures are biased low). So the search's own
ratio is no evidence that the pick's model is as good as the baseline's. :func:`heldout_check` answers that
after the search: the baseline and the pick trained again with fresh seeds (``seed_everything`` values the
search never used), interleaved in a random order, each model then evaluated on a **test split** that no
phase of the search ever read (a separate data file, given only to the test runs:
:func:`~lightning_energy.optimize.recommend_config.write_holdout_npz`), and :func:`compare_heldout` reports
both test losses (median ± half range), the energy (J) and the training process's CPU time (s) of each,
and their ratios (``lightning-energy recommend --test-data FILE`` runs it after the search). The baseline trains
as its config says (its ``max_epochs``, no stop at the target: what a user of the defaults spends); the pick
stops at the validation target.

The batch-size lever and a per-batch-sum loss: Baler's loss is summed over a batch, so a validation split
read in batches of the *training* batch size makes a smaller batch look better at the same model. Where the
config has an ``eval_batch_size`` key next to the batch size, every run keeps it at the baseline's batch
size (:func:`~lightning_energy.optimize.recommend_config.with_levers`); where it has none, the notes say so.
"""

from __future__ import annotations

import math
import random
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from lightning_energy.units import J_PER_KWH

DEFAULT_BETA = 2.0  # Zeus's BatchSizeOptimizer beta_knob: stop a trial past 2x the best cost
DEFAULT_REPEATS = 2
DEFAULT_REFINE_ROUNDS = 2
BASELINE = "baseline"
TARGET_FORMS = "METRIC=VALUE (a loss or error: reached at or below), METRIC<=VALUE or METRIC>=VALUE"
_FALLING_WORDS = ("loss", "err", "mse", "mae", "rmse", "perplexity")


class SearchError(RuntimeError):
    """The search cannot go on (the baseline itself does not reach the target)."""


@dataclass(frozen=True)
class Target:
    """``monitor`` reaching ``value``: at or below it (``mode="min"``) or at or above it (``"max"``)."""

    monitor: str
    value: float
    mode: str

    def __str__(self) -> str:
        return f"{self.monitor}{'<=' if self.mode == 'min' else '>='}{self.value:g}"


def parse_target(text: str) -> Target:
    """``val/loss=0.01`` (a loss falls), ``val/loss<=0.01`` or ``val/acc>=0.9``; ValueError names the problem."""
    match = re.fullmatch(r"\s*([^<>=\s]+)\s*(<=|>=|=)\s*(\S+)\s*", text or "")
    if match is None:
        raise ValueError(f"--target {text!r}: expected {TARGET_FORMS}, e.g. val/loss=0.002")
    monitor, operator, number = match.groups()
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"--target {text!r}: {number!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"--target {text!r}: the value must be finite")
    if operator == "=":
        if not any(word in monitor.lower() for word in _FALLING_WORDS):
            raise ValueError(f"--target {text!r}: say whether {monitor} must fall or rise: "
                             f"{monitor}<={number} or {monitor}>={number}")
        return Target(monitor, value, "min")
    return Target(monitor, value, "min" if operator == "<=" else "max")


@dataclass(frozen=True)
class Lever:
    """One thing the search changes: the config key it sets, its value there, the values to try."""

    name: str
    path: str | None  # dotted key of the LightningCLI config; None: applied by the runner (compile, power limit)
    baseline: Any
    alternatives: tuple
    what: str
    step: float | None = None  # numeric levers: the refinement's move is x step or / step (batch 2, rate 3)

    def neighbours(self, value: Any) -> tuple:
        """The values the refinement tries from ``value``: one step either way for a numeric lever (a batch
        size stays an integer of at least :data:`MIN_BATCH` rows), every other value for the rest."""
        if self.step is None:
            return tuple(v for v in (self.baseline, *self.alternatives) if v != value)
        if isinstance(self.baseline, int):
            moves = (int(value // self.step), int(value * self.step))
            return tuple(dict.fromkeys(v for v in moves if v >= MIN_BATCH and v != value))
        return tuple(dict.fromkeys(float(f"{value * f:.6g}") for f in (1 / self.step, self.step)))


@dataclass
class RunOutcome:
    """One run: the energy (J) and time (s) to the target when ``reached``, else what it spent before it stopped.

    ``stopped``: ``"target"``, ``"energy budget"``, ``"max epochs"`` or ``"failed: ..."``.
    """

    reached: bool
    energy_J: float
    time_s: float
    stopped: str = "target"
    epochs: int | None = None
    gCO2e: float | None = None
    provenance: str = "unknown"
    catalog_id: int | None = None
    run_dir: str | None = None

    @classmethod
    def failed(cls, why: str, run_dir: str | None = None) -> "RunOutcome":
        return cls(False, math.nan, math.nan, f"failed: {why}", run_dir=run_dir)


class Runner(Protocol):
    def __call__(self, settings: dict[str, Any], name: str, budget_J: float | None) -> RunOutcome:
        """Train the baseline with ``settings`` (lever name -> value) as run ``name``, ending it once it has
        spent ``budget_J`` without reaching the target (None: no budget)."""


def most_runs(levers: list["Lever"], screen_repeats: int, repeats: int, refine_rounds: int) -> int:
    """The most runs the search can take (no ``budget_runs``): screening and confirmation (the module
    docstring's bound), plus per refinement round every neighbour once per screen repeat and the challenger's
    top-up."""
    alternatives = sum(len(lever.alternatives) for lever in levers)
    base = screen_repeats * (1 + alternatives) + repeats * (3 + len(levers)) - 2 * screen_repeats
    neighbours = sum(2 if lever.step is not None else len(lever.alternatives) for lever in levers)
    return base + refine_rounds * (screen_repeats * neighbours + repeats - screen_repeats)


def co2_g(energy_J: float, g_per_kWh: float, pue: float = 1.0) -> float:
    """Grams CO2e of ``energy_J`` at an intensity (g/kWh) and PUE."""
    return energy_J / J_PER_KWH * g_per_kWh * pue


def describe(settings: dict[str, Any]) -> str:
    """``"baseline"`` or the changed levers, e.g. ``"batch_size=128, lr=0.003"``."""
    return ", ".join(f"{k}={v}" for k, v in settings.items()) or BASELINE


def _slug(settings: dict[str, Any]) -> str:
    text = "_".join(f"{k}-{v}" for k, v in settings.items()) or BASELINE
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", text)[:80]


@dataclass
class Trial:
    """A configuration (the baseline with ``settings`` changed) and its runs."""

    settings: dict[str, Any]
    stage: str
    runs: list[tuple[str, RunOutcome]] = field(default_factory=list)  # (run name, outcome), in run order
    lost: str | None = None  # why the configuration was dropped

    @property
    def name(self) -> str:
        return describe(self.settings)

    def reached_J(self) -> list[float]:
        return [o.energy_J for _, o in self.runs if o.reached]

    def complete(self, repeats: int) -> bool:
        return self.lost is None and len(self.runs) >= repeats and all(o.reached for _, o in self.runs)

    def median(self, attr: str) -> float:
        values = [getattr(o, attr) for _, o in self.runs if o.reached and getattr(o, attr) is not None]
        return statistics.median(values) if values else math.nan

    def half_range(self, attr: str) -> float:
        values = [getattr(o, attr) for _, o in self.runs if o.reached and getattr(o, attr) is not None]
        return (max(values) - min(values)) / 2 if len(values) > 1 else math.nan


@dataclass
class SearchResult:
    target: Target | None
    trials: list[Trial]
    recommended: Trial
    baseline: Trial
    winners: dict[str, Any]
    repeats: int
    beta: float
    runs: int
    skipped: int
    budget_exhausted: bool
    order: list[str]  # run names in the order they ran
    screen_repeats: int = 1

    def rows(self) -> list[dict]:
        """One row per configuration: medians and ± half-ranges of energy, time and CO2 to target."""
        base_J = self.baseline.median("energy_J")
        out = []
        for trial in self.trials:
            energy = trial.median("energy_J")
            spent = [o for _, o in trial.runs if not o.reached]
            status = ("recommended" if trial is self.recommended else
                      f"lost: {trial.lost}" if trial.lost else
                      "ok" if trial.complete(self.repeats) else
                      "screened" if trial.complete(self.screen_repeats) else "incomplete (run budget)")
            out.append({
                "config": trial.name, "settings": dict(trial.settings), "stage": trial.stage,
                "runs": len(trial.runs), "reached": sum(o.reached for _, o in trial.runs),
                "energy_J": energy, "energy_J_pm": trial.half_range("energy_J"),
                "time_s": trial.median("time_s"), "time_s_pm": trial.half_range("time_s"),
                "gCO2e": trial.median("gCO2e"), "gCO2e_pm": trial.half_range("gCO2e"),
                "epochs": trial.median("epochs"),
                "energy_ratio": base_J / energy if energy > 0 else math.nan,
                "spent_J": max((o.energy_J for o in spent if math.isfinite(o.energy_J)), default=None),
                "provenance": _provenance(trial), "status": status,
                "run_names": [name for name, _ in trial.runs],
            })
        return out

    def lever_effects(self) -> list[dict]:
        """What each lever gave: alone against the baseline, and (for the winners) left out of the combination."""
        by_settings = {_key(t.settings): t for t in self.trials}
        base_J = self.baseline.median("energy_J")
        combined = by_settings.get(_key(self.winners)) if len(self.winners) > 1 else None
        effects = []
        for trial in self.trials:
            # alone: its screening runs (a later confirmation run may have been stopped at Zeus's budget)
            if trial.stage != "one lever" or len(trial.reached_J()) < self.screen_repeats:
                continue
            (lever, value), = trial.settings.items()
            entry = {"lever": lever, "value": value, "alone_x": base_J / trial.median("energy_J"),
                     "winner": self.winners.get(lever) == value, "in_combination_x": None,
                     "in_combination_at_least": False}
            if entry["winner"] and combined is not None and combined.complete(self.repeats):
                without = by_settings.get(_key({k: v for k, v in self.winners.items() if k != lever}))
                spent = [o.energy_J for _, o in without.runs if o.stopped == "energy budget"] if without else []
                if without is not None and without.complete(self.repeats):
                    entry["in_combination_x"] = without.median("energy_J") / combined.median("energy_J")
                elif spent:  # stopped at the budget: it would have cost at least that much
                    entry["in_combination_x"] = max(spent) / combined.median("energy_J")
                    entry["in_combination_at_least"] = True
            effects.append(entry)
        return effects


def _key(settings: dict[str, Any]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in settings.items()))


def _provenance(trial: Trial) -> str:
    from lightning_energy.provenance import combine

    kinds = [o.provenance for _, o in trial.runs if o.provenance not in (None, "unknown")]
    return combine(kinds) if kinds else "unknown"


class Search:
    """The one-lever-at-a-time search with combination (see the module docstring).

    Args:
        levers: what to vary (:func:`find_levers`).
        runner: trains one configuration (:class:`~lightning_energy.optimize.recommend_config.ConfigRunner`, or a
            cost model in tests).
        repeats: runs of each confirmed configuration (``R``).
        screen_repeats: runs of each configuration while screening one lever at a time (``S``, default R).
        beta: a run's energy budget is ``beta`` x the lowest energy to target finished so far.
        budget_runs: the most runs in all (None: no cap).
        refine_rounds: rounds of coordinate descent from the best confirmed configuration (0: none).
        seed: seed of the random run order.
        log: called with one line per run.
    """

    def __init__(self, levers: list[Lever], runner: Runner, repeats: int = DEFAULT_REPEATS,
                 beta: float = DEFAULT_BETA, budget_runs: int | None = None, seed: int = 0,
                 log: Callable[[str], None] | None = None, target: Target | None = None,
                 screen_repeats: int | None = None, refine_rounds: int = DEFAULT_REFINE_ROUNDS) -> None:
        screen_repeats = repeats if screen_repeats is None else screen_repeats
        if not 1 <= screen_repeats <= repeats:
            raise ValueError(f"need 1 <= screen_repeats <= repeats, got {screen_repeats} and {repeats}")
        if not beta > 1:
            raise ValueError(f"`beta` must be > 1, got {beta}")
        if budget_runs is not None and budget_runs < 1:
            raise ValueError(f"`budget_runs` must be >= 1, got {budget_runs}")
        if isinstance(refine_rounds, bool) or not isinstance(refine_rounds, int) or refine_rounds < 0:
            raise ValueError(f"`refine_rounds` must be an integer >= 0, got {refine_rounds!r}")
        self.refine_rounds = refine_rounds
        self.levers, self.runner, self.repeats, self.beta = levers, runner, repeats, beta
        self.screen_repeats = screen_repeats
        self.budget_runs, self.target = budget_runs, target
        self.rng = random.Random(seed)
        self.log = log or (lambda line: None)
        self.trials: dict[tuple, Trial] = {}
        self.order: list[str] = []
        self.skipped = 0
        self.budget_exhausted = False

    def run(self) -> SearchResult:
        baseline = self._trial({}, BASELINE)
        self._run_once(baseline)
        if not baseline.complete(1):
            _, outcome = baseline.runs[0]
            raise SearchError(f"the baseline did not reach the target ({outcome.stopped}); "
                              "give a target the config reaches within its max_epochs")
        stage = [baseline] + [self._trial({lever.name: value}, "one lever")
                              for lever in self.levers for value in lever.alternatives]
        self._run_repeats(stage, self.screen_repeats, against=baseline)
        winners = self.winners()
        confirm = [baseline, self._trial(dict(winners), "combined")] if winners else [baseline]
        if len(winners) > 1:
            confirm += [self._trial({k: v for k, v in winners.items() if k != left_out}, "leave one out")
                        for left_out in winners]
            # levers interact (a smaller batch may want no other change): the best single change competes too
            screened = [t for t in stage[1:] if t.complete(self.screen_repeats)]
            if screened:
                confirm.append(min(screened, key=lambda t: t.median("energy_J")))
        self._run_repeats(confirm, self.repeats)
        best = self.refine(self._best())
        return SearchResult(self.target, list(self.trials.values()), best, baseline, winners, self.repeats,
                            self.beta, len(self.order), self.skipped, self.budget_exhausted, list(self.order),
                            self.screen_repeats)

    def _best(self) -> Trial:
        """The lowest median energy to target among the configurations with every repeat reached (else those
        screened, else the baseline)."""
        trials = list(self.trials.values())
        complete = ([t for t in trials if t.complete(self.repeats)] or
                    [t for t in trials if t.complete(self.screen_repeats)] or [self.trials[_key({})]])
        return min(complete, key=lambda t: t.median("energy_J"))

    def neighbours(self, settings: dict[str, Any]) -> list[dict[str, Any]]:
        """``settings`` with one lever moved (:meth:`Lever.neighbours`); a lever back at its baseline value is
        dropped from the settings, so each configuration has one name."""
        out = []
        for lever in self.levers:
            current = settings.get(lever.name, lever.baseline)
            for value in lever.neighbours(current):
                moved = {**settings, lever.name: value}
                out.append({other.name: moved[other.name] for other in self.levers  # in the levers' order
                            if other.name in moved and moved[other.name] != other.baseline})
        return out

    def refine(self, best: Trial) -> Trial:
        """Coordinate descent from ``best`` (step 4 of the module docstring); returns the best found."""
        for round_ in range(1, self.refine_rounds + 1):
            if not best.complete(self.repeats) or self._out_of_runs():
                break
            fresh = [s for s in self.neighbours(best.settings) if _key(s) not in self.trials]
            candidates = [self._trial(s, f"refine {round_}") for s in fresh]
            if not candidates:
                break
            self._run_repeats(candidates, self.screen_repeats, against=best)
            floor = min(best.reached_J())
            beating = [t for t in candidates if self._beat_every_run(t, floor)]
            if not beating:
                break
            challenger = min(beating, key=lambda t: t.median("energy_J"))
            self._run_repeats([best, challenger], self.repeats)
            if not (challenger.complete(self.repeats) and
                    challenger.median("energy_J") < best.median("energy_J")):
                break
            best = challenger
        return best

    def _beat_every_run(self, trial: Trial, floor_J: float) -> bool:
        """``trial`` screened, every run reached, each below ``floor_J`` (the lowest run of what it must beat)."""
        return trial.complete(self.screen_repeats) and max(trial.reached_J()) < floor_J

    def _out_of_runs(self) -> bool:
        return self.budget_runs is not None and len(self.order) >= self.budget_runs

    def winners(self) -> dict[str, Any]:
        """Per lever, the alternative with the lowest median energy among those whose every run beat every
        baseline run (completed configurations only)."""
        baseline = self.trials[_key({})]
        base_min = min(baseline.reached_J(), default=math.nan)
        out = {}
        for lever in self.levers:
            beating = [t for value in lever.alternatives
                       if (t := self.trials.get(_key({lever.name: value}))) is not None
                       and self._beat_every_run(t, base_min)]
            if beating:
                best = min(beating, key=lambda t: t.median("energy_J"))
                out[lever.name] = best.settings[lever.name]
        return out

    # ---------------------------------------------------------------- running
    def _trial(self, settings: dict[str, Any], stage: str) -> Trial:
        return self.trials.setdefault(_key(settings), Trial(dict(settings), stage))

    def _run_repeats(self, trials: list[Trial], repeats: int, against: Trial | None = None) -> None:
        """Run every trial up to ``repeats`` runs, in rounds (each trial one more run per round, in a new random
        order each round: drift spreads over all, and a run budget that ends the search leaves no trial of
        the stage unmeasured while another has its repeats); each run's budget is the lowest energy to
        target of ``against`` (the configuration it must beat: the baseline while screening, the best while
        refining), else ``beta`` x the best finished."""
        queue = []
        for round_ in range(repeats):
            members = [t for t in trials if len(t.runs) + sum(q is t for q in queue) < repeats]
            self.rng.shuffle(members)
            queue += members
        for trial in queue:
            if trial.lost is not None:
                self.skipped += 1
                continue
            self._run_once(trial, against)

    def best_J(self) -> float | None:
        finished = [j for t in self.trials.values() for j in t.reached_J() if j > 0]
        return min(finished) if finished else None

    def _run_once(self, trial: Trial, against: Trial | None = None) -> None:
        if self._out_of_runs():
            self.budget_exhausted = True
            self.skipped += 1
            return
        best = self.best_J()
        against_J = min(against.reached_J(), default=None) if against is not None else None
        if not trial.settings or best is None:  # the baseline is the reference of every ratio: never cut
            budget_J, why = None, ""
        elif against_J is not None:
            whose = "the baseline's" if not against.settings else f"the best's ({against.name})"
            budget_J, why = against_J, f" (budget: {whose} {against_J:.4g} J)"
        else:
            budget_J, why = self.beta * best, f" (budget {self.beta:g} x best {best:.4g} J)"
        name = f"r{len(self.order):03d}_{_slug(trial.settings)}"
        outcome = self.runner(dict(trial.settings), name, budget_J)
        self.order.append(name)
        trial.runs.append((name, outcome))
        if not outcome.reached:
            where = f" after {outcome.energy_J:.4g} J" if math.isfinite(outcome.energy_J) else ""
            trial.lost = f"{outcome.stopped}{where}{why if outcome.stopped == 'energy budget' else ''}"
        verdict = (f"reached in {outcome.energy_J:.4g} J, {outcome.time_s:.3g} s" if outcome.reached
                   else f"stopped: {trial.lost}")
        self.log(f"run {len(self.order):>3} {name}: {trial.name}: {verdict}")


# ---------------------------------------------------------------- the held-out check
DEFAULTS = "defaults"
RECOMMENDED = "recommended"


@dataclass
class HeldOutRun:
    """One training of a configuration with a fresh seed, then its model evaluated on the test split.

    ``energy_J``: the fit's energy (J; the pick stops at the validation target, the defaults train all their
    epochs); ``energy_to_target_J``: to the validation target when reached (else None); ``cpu_s``: CPU time of
    the training process from the fit's start to its end (s; all its threads); ``time_s``: wall time of the
    fit (s); ``test_loss``: the test split's ``test_metric`` of the final weights; ``load_average``: the
    machine's 1-minute load average when the run ended (a busy shared machine stretches the figures).
    """

    config: str
    seed: int
    energy_J: float
    cpu_s: float
    time_s: float
    test_loss: float
    epochs: int | None = None
    energy_to_target_J: float | None = None
    reached: bool = False
    provenance: str = "unknown"
    load_average: float | None = None
    stopped: str = ""

    @property
    def ok(self) -> bool:
        return all(math.isfinite(v) for v in (self.energy_J, self.cpu_s, self.test_loss))


class HeldOutRunner(Protocol):
    def __call__(self, settings: dict[str, Any], name: str, seed: int, stop_at_target: bool) -> HeldOutRun:
        """Train the baseline with ``settings`` as run ``name`` with ``seed_everything: seed`` (stopping at the
        validation target when ``stop_at_target``), then evaluate its final weights on the test split."""


def heldout_check(runner: HeldOutRunner, recommended: dict[str, Any], seeds: list[int], order_seed: int = 0,
                  log: Callable[[str], None] | None = None) -> list[HeldOutRun]:
    """The defaults (``{}``, trained as configured) and the pick (``recommended``, stopped at the validation
    target) once per seed; each seed's two runs in a random order (a shared machine's drift spreads over both).
    """
    if not seeds:
        raise ValueError("the held-out check needs at least one seed")
    rng = random.Random(order_seed)
    log = log or (lambda line: None)
    runs = []
    for seed in seeds:
        pair = [(DEFAULTS, {}, False), (RECOMMENDED, dict(recommended), True)]
        rng.shuffle(pair)
        for config, settings, stop in pair:
            run = runner(settings, f"heldout_{config}_seed{seed}", seed, stop)
            run.config, run.seed = config, seed
            runs.append(run)
            log(f"held out: {config} seed {seed}: {run.energy_J:.4g} J, {run.cpu_s:.3g} CPU s, "
                f"test loss {run.test_loss:.6g}{'' if run.ok else ' (' + run.stopped + ')'}")
    return runs


DEFAULT_HELDOUT_SEEDS = (1, 2, 3)


def parse_seeds(text: str, search_seed: int | None = None) -> list[int]:
    """``"1,2,3"``: the held-out check's ``seed_everything`` values (distinct integers, none the search's own
    ``search_seed``); ValueError names the problem."""
    try:
        seeds = [int(part) for part in (text or "").split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--test-seeds {text!r}: expected integers separated by commas, e.g. 1,2,3") from None
    if not seeds or len(set(seeds)) != len(seeds) or any(s < 0 or s > 2**32 - 1 for s in seeds):
        raise ValueError(f"--test-seeds {text!r}: expected distinct integers in [0, 2**32), e.g. 1,2,3")
    if search_seed is not None and search_seed in seeds:
        raise ValueError(f"--test-seeds {text!r}: {search_seed} is the config's seed_everything, which the search "
                         "trains with: the held-out check needs fresh seeds")
    return seeds


def heldout_metric_for(monitor: str) -> str | None:
    """The test run's metric that matches the validation ``monitor`` (``val/loss`` -> ``test/loss``,
    ``val_loss`` -> ``test_loss``), or None when ``monitor`` does not name a validation metric."""
    match = re.fullmatch(r"val(idation)?([/_.].+)", monitor)
    return f"test{match.group(2)}" if match else None


def _spread(values: list[float]) -> dict:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return {"median": math.nan, "pm": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(values), "pm": (max(values) - min(values)) / 2 if len(values) > 1
            else math.nan, "min": min(values), "max": max(values), "n": len(values)}


def compare_heldout(runs: list[HeldOutRun]) -> dict:
    """Both configurations' test losses, energies and CPU times (median, ± half range, min, max over seeds),
    the ratios of the medians (defaults / pick: > 1 means the pick spends less), and the verdict.

    ``test_no_worse``: the pick's median test loss is at most the defaults' worst over the seeds (within the
    defaults' own seed-to-seed spread); ``test_no_worse_strict``: at most the defaults' median. A seed whose
    run failed counts against the pick: both verdicts are False unless every run of both is complete.
    """
    out: dict[str, Any] = {}
    for config in (DEFAULTS, RECOMMENDED):
        mine = [r for r in runs if r.config == config]
        out[config] = {"runs": len(mine), "complete": sum(r.ok for r in mine),
                       "reached_target": sum(r.reached for r in mine),
                       **{attr: _spread([getattr(r, attr) for r in mine if r.ok])
                          for attr in ("test_loss", "energy_J", "cpu_s", "time_s", "energy_to_target_J")},
                       "epochs": _spread([r.epochs for r in mine if r.ok and r.epochs is not None]),
                       "load_average": _spread([r.load_average for r in mine]),
                       "provenance": _combined([r.provenance for r in mine])}
    d, p = out[DEFAULTS], out[RECOMMENDED]
    complete = d["complete"] == d["runs"] > 0 and p["complete"] == p["runs"] > 0
    ratio = (lambda a, b: a / b if b > 0 else math.nan)
    out["energy_ratio"] = ratio(d["energy_J"]["median"], p["energy_J"]["median"])
    out["cpu_ratio"] = ratio(d["cpu_s"]["median"], p["cpu_s"]["median"])
    out["time_ratio"] = ratio(d["time_s"]["median"], p["time_s"]["median"])
    out["test_no_worse"] = bool(complete and p["test_loss"]["median"] <= d["test_loss"]["max"])
    out["test_no_worse_strict"] = bool(complete and p["test_loss"]["median"] <= d["test_loss"]["median"])
    out["test_loss_ratio"] = ratio(p["test_loss"]["median"], d["test_loss"]["median"])
    return out


def _combined(kinds: list[str]) -> str:
    from lightning_energy.provenance import combine

    kinds = [k for k in kinds if k not in (None, "unknown")]
    return combine(kinds) if kinds else "unknown"


# ---------------------------------------------------------------- the levers of a config
BATCH_KEYS = ("batch_size",)
EVAL_BATCH_KEYS = ("eval_batch_size",)
LR_KEYS = ("lr", "learning_rate")
SCHEDULE_KEYS = ("lr_patience",)
SCHEDULE_PATIENCE = 3  # epochs of a ReduceLROnPlateau patience to try (Baler's default is 50)
LR_FACTORS = (3, 10, 30)
MIN_BATCH = 8
BATCH_STEP = 2  # the refinement's move of the batch size: x2 or /2
LR_STEP = 3  # the refinement's move of the learning rate: x3 or /3
LEVER_NAMES = ("precision", "dtype", "batch_size", "lr", "lr_schedule", "shuffle", "compile", "power_limit_W")


def config_key(config: dict, section: str, names: tuple[str, ...]) -> tuple[str, Any] | None:
    """(dotted path, value) of the first of ``names`` under ``config[section]`` or its ``init_args``."""
    part = config.get(section)
    if not isinstance(part, dict):
        return None
    for prefix, mapping in ((section, part), (f"{section}.init_args", part.get("init_args"))):
        if isinstance(mapping, dict):
            for name in names:
                if name in mapping:
                    return f"{prefix}.{name}", mapping[name]
    return None


def find_levers(config: dict, device: str = "cpu", power_limits_W: list[float] | None = None,
                compile_in_config: bool = False) -> tuple[list[Lever], list[str]]:
    """The levers this (merged LightningCLI) config offers on ``device`` (``"cpu"`` or ``"cuda"``), and notes on
    those it does not."""
    levers, notes = [], []
    trainer = config.get("trainer") if isinstance(config.get("trainer"), dict) else {}
    precision = str(trainer.get("precision", "32-true"))
    options = ["32-true", "bf16-mixed"] + (["16-mixed"] if device == "cuda" else [])
    if precision == "64-true":
        options.insert(0, "64-true")
    others = tuple(p for p in options if p != precision)
    levers.append(Lever("precision", "trainer.precision", precision, others,
                        "Lightning precision (PrecisionSwitch's modes that run on this device)"))
    dtype = config_key(config, "model", ("dtype",))
    if dtype is not None and dtype[1] == "float64":
        levers.append(Lever("dtype", dtype[0], "float64", ("float32",), "the model's parameter dtype"))
    batch = config_key(config, "data", BATCH_KEYS) or config_key(config, "model", BATCH_KEYS)
    if batch is not None and isinstance(batch[1], int) and not isinstance(batch[1], bool):
        size = batch[1]
        values = tuple(dict.fromkeys(b for b in (size // 4, size // 2, size * 2) if b >= MIN_BATCH and b != size))
        levers.append(Lever("batch_size", batch[0], size, values, "rows per batch", step=BATCH_STEP))
        if eval_batch_path(config, batch[0]) is None:
            notes.append("batch size: validation batches follow the training batch size (no eval_batch_size "
                         "beside it): a loss summed per batch then changes with the batch size at the same model")
    else:
        notes.append("batch size: not explored (no batch_size under data or model in the config)")
    lr = config_key(config, "model", LR_KEYS)
    if lr is not None and isinstance(lr[1], (int, float)) and not isinstance(lr[1], bool) and lr[1] > 0:
        levers.append(Lever("lr", lr[0], lr[1], tuple(float(f"{lr[1] * f:.6g}") for f in LR_FACTORS),
                            "learning rate", step=LR_STEP))
    else:
        notes.append("learning rate: not explored (no lr or learning_rate under model in the config)")
    schedule = config_key(config, "model", SCHEDULE_KEYS)
    if schedule is not None and isinstance(schedule[1], int) and schedule[1] > SCHEDULE_PATIENCE:
        levers.append(Lever("lr_schedule", schedule[0], schedule[1], (SCHEDULE_PATIENCE,),
                            "ReduceLROnPlateau patience (epochs): halve the rate sooner on a plateau"))
    shuffle = config_key(config, "data", ("shuffle",))
    if shuffle is not None and isinstance(shuffle[1], bool):
        levers.append(Lever("shuffle", shuffle[0], shuffle[1], (not shuffle[1],), "shuffle the training rows"))
    if not compile_in_config:
        levers.append(Lever("compile", None, False, (True,), "torch.compile the model's layers (CompileModel)"))
    if device != "cuda":
        notes.append("power limit: not explored (training runs on the CPU: no NVIDIA GPU power limit to set)")
    elif power_limits_W:
        levers.append(Lever("power_limit_W", None, None, tuple(power_limits_W), "GPU power limit (W)"))
    else:
        notes.append("power limit: not explored (give --power-limits W,W,... to try limits on the GPU)")
    return levers, notes


def eval_batch_path(config: dict, batch_path: str) -> str | None:
    """The dotted key of the evaluation batch size beside ``batch_path`` (``data.eval_batch_size``) where the
    config has one (any value, null included), else None."""
    parent = batch_path.rpartition(".")[0]
    node: Any = config
    for part in parent.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict):
        return None
    return next((f"{parent}.{k}" for k in EVAL_BATCH_KEYS if k in node), None)


def select_levers(levers: list[Lever], names: list[str] | None) -> list[Lever]:
    """The levers named (all when None); ValueError names an unknown or unavailable one."""
    if names is None:
        return levers
    available = {lever.name: lever for lever in levers}
    unknown = [n for n in names if n not in LEVER_NAMES]
    if unknown:
        raise ValueError(f"--levers: unknown lever(s) {unknown}; levers: {', '.join(LEVER_NAMES)}")
    missing = [n for n in names if n not in available]
    if missing:
        raise ValueError(f"--levers: {missing} not available for this config; available: "
                         f"{', '.join(available)}")
    return [available[n] for n in names]
