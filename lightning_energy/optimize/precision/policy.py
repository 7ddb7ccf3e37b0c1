"""How ``PrecisionSwitch`` decides: profiling rounds, the A/A noise floor, a pick beyond the noise, the guard.

Plain Python over measured numbers (no Lightning import): the callback feeds a :class:`PrecisionPolicy` the
optimizer steps it sees (the mode each ran in, a non-finite step), the per-step energy (J) and time (s) of
each profiled window, the loss statistics of a window (see :data:`N_STATS`), and applies what it answers:
which mode to train in next and why. Everything here can be tested on plain numbers, without a Trainer.

The rules (the callback's docstring tells them from the user's side):

1. Profiling, in rounds. A round profiles ``32-true``, then each candidate, then (``noise_floor``) ``32-true``
   once more: ``warmup_steps`` + ``profile_steps`` steps each (a window). The two reference windows of a
   round are an A/A pair, whose difference is the noise floor a pick must beat (:func:`merge_profiles`).
2. Pick, beyond the noise (:func:`settle_mode`): among the modes with no failure and a loss gap within
   ``tolerance``, a mode other than ``32-true`` is chosen only when it is cheaper by ``objective`` beyond the
   two-sided Student-t bound at ``confidence``; else the modes within noise of the cheapest are profiled
   again, up to ``max_profile_rounds`` rounds, each round in the reverse order of the one before; a mode other
   than ``32-true`` is picked only after a multiple of ``min_profile_rounds`` rounds.
   A mode whose gradients on its probed steps differ from a float32 replay's by more than ``grad_tolerance``
   (relative error of the gradient vector, :mod:`~lightning_energy.optimize.precision.gradients`) is
   rejected, whatever its loss gap.
3. Guard (:meth:`PrecisionPolicy.guard_verdict`): fall back to the next safer mode on non-finite steps, an
   exploding loss, or a loss gap beyond ``tolerance`` or a gradient error beyond ``grad_tolerance`` at
   ``drift_patience`` checks in a row.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from lightning_energy.optimize.precision.gradients import (
    DEFAULT_GRAD_TOLERANCE,
    N_GRAD_STATS,
    gradient_summary,
    gradient_verdict,
)
from lightning_energy.optimize.precision.modes import MODES, REFERENCE_MODE, get_mode, unavailable_reason

DEFAULT_CANDIDATES = ("32-true", "bf16-mixed", "16-mixed")
OBJECTIVES = ("energy", "time", "edp")

# The statistics of a window of training steps, summed over steps and ranks (a float64 vector of N_STATS):
# the finite losses' sum, their count, the non-finite losses' count, and over the probed steps with both
# losses finite: the sum of (loss - reference), the sum of the reference losses, their count; then, from
# GRAD_STATS on, the gradient statistics of the probed steps against float32's (gradients.GRAD_FIELDS)
LOSS_SUM, LOSS_N, NONFINITE, DIFF_SUM, REF_SUM, GAP_N = range(6)
GRAD_STATS = 6
N_STATS = GRAD_STATS + N_GRAD_STATS

# phases of a fit
FIXED, PROFILING, GUARDING = "fixed", "profiling", "guarding"
# what an optimizer step calls for (PrecisionPolicy.after_step)
NOTHING, WINDOW_DONE, FALL_BACK, CHECK = "nothing", "window done", "fall back", "check"


class PrecisionPolicy:
    """The decisions of ``PrecisionSwitch`` over one fit, fed with measured numbers.

    Arguments as ``PrecisionSwitch``'s (``mode`` here: ``fixed_mode``); each is validated on construction with
    a ``ValueError`` (``TypeError`` for ``noise_floor``) naming it.

    Attributes (the state of a fit; :meth:`reset` starts a new one):
        plan: the modes profiled (``32-true`` first); ``[fixed_mode]`` for a fixed mode.
        phase: :data:`FIXED`, :data:`PROFILING` or :data:`GUARDING`.
        current: the mode the policy last chose to train in (None before the first).
        chosen, decision: the mode picked at the end of profiling and why.
        profiles: the per-mode table once profiling is over (rows of :func:`merge_profiles`).
        rejected: mode -> why it is not used again in this fit.
        local_profiles: this rank's profile of each mode over the rounds so far (:func:`add_profile`).
        round: the windows of this round, in order; profile_index: the window being profiled.
        profile_rounds: rounds finished.
    """

    def __init__(
        self, candidates: Sequence[str] | None = None, tolerance: float = 0.02, fixed_mode: str | None = None,
        warmup_steps: int = 5, profile_steps: int = 20, check_every_n_steps: int = 50, probe_batches: int = 4,
        confidence: float = 0.95, max_profile_rounds: int = 4, min_profile_rounds: int = 2,
        noise_floor: bool = True, drift_patience: int = 2, explode_factor: float = 10.0,
        max_consecutive_skips: int = 10, objective: str = "energy", grad_tolerance: float = DEFAULT_GRAD_TOLERANCE,
    ) -> None:
        if fixed_mode is not None and candidates is not None:
            raise ValueError("give either `mode` (a fixed mode) or `candidates` (modes to choose from), not both")
        self.fixed_mode = None if fixed_mode is None else get_mode(fixed_mode, "mode").name
        if candidates is None:
            candidates = DEFAULT_CANDIDATES
        if isinstance(candidates, str) or not isinstance(candidates, Sequence) or not candidates:
            raise ValueError(f"`candidates` must be a non-empty list of mode names, got {candidates!r}")
        for name in candidates:
            if get_mode(name, "candidates").param_dtype != MODES[REFERENCE_MODE].param_dtype:
                raise ValueError(
                    f"`candidates` cannot contain {name!r}: changing the parameters' dtype mid-run is not supported; "
                    f"use PrecisionSwitch(mode={name!r}) to train in it from the start"
                )
        if len(set(candidates)) != len(candidates):
            raise ValueError(f"`candidates` has duplicates: {list(candidates)}")
        self.candidates = list(candidates)
        self.tolerance = positive_float("tolerance", tolerance)
        self.grad_tolerance = positive_float("grad_tolerance", grad_tolerance)
        self.explode_factor = positive_float("explode_factor", explode_factor)
        if self.explode_factor <= 1:
            raise ValueError(f"`explode_factor` must be > 1, got {explode_factor!r}")
        self.warmup_steps = int_at_least("warmup_steps", warmup_steps, 0)
        self.profile_steps = int_at_least("profile_steps", profile_steps, 1)
        self.check_every_n_steps = int_at_least("check_every_n_steps", check_every_n_steps, 0)
        self.probe_batches = int_at_least("probe_batches", probe_batches, 1)
        if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
            raise ValueError(f"`confidence` must be a number in (0, 1), got {confidence!r}")
        self.confidence = float(confidence)
        self.max_profile_rounds = int_at_least("max_profile_rounds", max_profile_rounds, 1)
        self.min_profile_rounds = int_at_least("min_profile_rounds", min_profile_rounds, 1)
        if not isinstance(noise_floor, bool):
            raise TypeError(f"`noise_floor` must be a bool, got {type(noise_floor).__name__}")
        self.noise_floor = noise_floor
        self.drift_patience = int_at_least("drift_patience", drift_patience, 1)
        self.max_consecutive_skips = int_at_least("max_consecutive_skips", max_consecutive_skips, 1)
        if objective not in OBJECTIVES:
            raise ValueError(f"`objective` must be one of {OBJECTIVES}, got {objective!r}")
        self.objective = objective
        self.reset()

    # ---------------------------------------------------------------- a fit
    def reset(self) -> None:
        """A new fit: nothing profiled, nothing rejected."""
        self.plan: list[str] = [self.fixed_mode] if self.fixed_mode else []
        self.phase = FIXED if self.fixed_mode else PROFILING
        self.current: str | None = self.fixed_mode
        self.chosen: str | None = self.fixed_mode
        self.decision: str | None = "fixed mode" if self.fixed_mode else None
        self.profiles: dict[str, dict] = {}
        self.rejected: dict[str, str] = {}
        self.local_profiles: dict[str, dict] = {}
        self.round: list[str] = list(self.plan)
        self.profile_rounds = 0
        self.profile_index = 0
        self.steps_in_mode = 0  # steps of the current profiling window so far
        self.best_loss = math.inf  # the lowest window mean loss so far (the exploding-loss rule)
        self.drift_strikes = 0  # checks in a row with a loss gap beyond tolerance
        self.since_check = 0  # steps since the last guard check

    def plan_for(self, device_type: str) -> dict[str, str]:
        """Plan profiling on ``device_type`` (choosing only): ``32-true`` and the candidates that run there.
        Returns the dropped candidates and why (also kept in :attr:`rejected`)."""
        dropped = {}
        self.plan = [REFERENCE_MODE]
        for name in self.candidates:
            if name == REFERENCE_MODE:
                continue
            if reason := unavailable_reason(MODES[name], device_type):
                dropped[name] = reason
                self.rejected[name] = f"unavailable: {reason}"
                continue
            self.plan.append(name)
        self.round = round_order(self.plan, self.noise_floor)
        return dropped

    @property
    def window_mode(self) -> str:
        """The mode of the profiling window under way (the phase is :data:`PROFILING`)."""
        return self.round[self.profile_index]

    def start_mode(self) -> str | None:
        """The mode training (re)starts in: the window being profiled, else the current mode."""
        if self.phase == PROFILING:
            self.steps_in_mode = 0  # a window cut by a restart is profiled from its warm-up again
            return self.window_mode
        return self.current

    def start_reason(self) -> str:
        if self.phase == FIXED:
            return "fixed mode"
        if self.phase == PROFILING:
            return f"profiling {self.profile_index + 1}/{len(self.round)}"
        return f"resumed; {self.decision}" if self.decision else "resumed"

    # ---------------------------------------------------------------- each optimizer step
    def profiled_mode(self, mode: str) -> str | None:
        """The mode whose profile a step now starting in ``mode`` counts in (past its warm-up), else None."""
        if self.phase != PROFILING or mode != self.window_mode:
            return None
        return mode if self.steps_in_mode >= self.warmup_steps else None

    def probe_due(self, mode: str) -> bool:
        """Whether a step starting in ``mode`` is replayed in ``32-true`` (its loss gap measured)."""
        if mode == REFERENCE_MODE:
            return False
        if self.phase == PROFILING:
            return mode == self.window_mode
        # the last ``probe_batches`` steps before each check
        return self.check_every_n_steps > 0 and self.since_check >= self.check_every_n_steps - self.probe_batches

    def step_failure(self, mode: str, skipped: bool, consecutive_skips: int) -> str | None:
        """A failed optimizer step in ``mode``, or None: ``skipped`` (the plugin skipped this step for
        non-finite gradients) fails at once, except under gradient scaling, where only
        ``max_consecutive_skips`` skips in a row fail (the scaler skips now and then by design)."""
        if not skipped:
            return None
        if MODES[mode].grad_scaling:
            if consecutive_skips >= self.max_consecutive_skips:
                return f"gradient scaler skipped {consecutive_skips} steps in a row (non-finite gradients)"
            return None
        return "non-finite gradients (optimizer step skipped)"

    def after_step(self, mode: str, failure: str | None) -> str:
        """What the optimizer step just taken in ``mode`` calls for: :data:`WINDOW_DONE` (profiling: the
        window is over, call :meth:`window_finished`), :data:`FALL_BACK` (guarding: ``failure``, call
        :meth:`fall_back`), :data:`CHECK` (a guard check is due: measure the window, :meth:`guard_verdict`)
        or :data:`NOTHING`."""
        if self.phase == PROFILING:
            if mode != self.window_mode:
                return NOTHING  # a deferred switch (gradient accumulation) has not happened yet
            self.steps_in_mode += 1
            done = self.steps_in_mode >= self.warmup_steps + self.profile_steps
            return WINDOW_DONE if failure is not None or done else NOTHING
        if self.phase == GUARDING and failure is not None:
            return FALL_BACK
        self.since_check += 1
        if self.check_every_n_steps and self.since_check >= self.check_every_n_steps:
            return CHECK
        return NOTHING

    # ---------------------------------------------------------------- profiling
    def window_finished(self, part: dict) -> str | None:
        """This rank's profile of the window just finished (``{"per_step": [[step, J, s, round, window],
        ...], "stats": [N_STATS numbers], "failure": str | None}``): the next window's mode, or None when the
        round is over (then :meth:`settle` on rank zero and :meth:`apply_round` on every rank)."""
        target = self.window_mode
        self.local_profiles[target] = add_profile(self.local_profiles.get(target), part)
        self.profile_index += 1
        self.steps_in_mode = 0
        if self.profile_index < len(self.round):
            self.current = self.window_mode
            return self.current
        self.profile_rounds += 1
        return None

    def profiling_reason(self) -> str:
        text = f"profiling {self.profile_index + 1}/{len(self.round)}"
        return text + (f", round {self.profile_rounds + 1}" if self.profile_rounds else "")

    def settle(self, local_profiles_per_rank: list[dict[str, dict]]) -> dict:
        """The decision at the end of a round from every rank's :attr:`local_profiles` (:func:`settle_mode`,
        with the merged per-mode table under ``"profiles"``); computed on one rank, applied on all."""
        profiles = merge_profiles(local_profiles_per_rank, self.plan)
        final = self.profile_rounds >= self.max_profile_rounds
        decision = settle_mode(profiles, self.tolerance, self.objective, self.confidence, final,
                               self.profile_rounds, self.min_profile_rounds, self.grad_tolerance)
        decision["profiles"] = profiles
        return decision

    def apply_round(self, decision: dict) -> tuple[str, str]:
        """Apply :meth:`settle`'s decision: (the mode to switch to, why). Profiling goes on in another round
        (the contenders, in the reverse order of the last round) or is over (phase :data:`GUARDING`)."""
        if decision["chosen"] is None:
            self.round = round_order([m for m in self.plan if m in decision["contenders"]], self.noise_floor)
            if self.profile_rounds % 2:  # every other round in reverse order: load drift cancels in the pool
                self.round.reverse()
            self.profile_index = 0
            self.current = self.round[0]
            return self.current, self.profiling_reason()
        self.profiles = decision["profiles"]
        for name, row in self.profiles.items():
            if row["status"].startswith("rejected"):
                self.rejected[name] = row["status"]
        means = [row["mean_loss"] for row in self.profiles.values() if row["mean_loss"] is not None]
        self.best_loss = min(means, default=math.inf)
        self.phase = GUARDING
        self.chosen, self.decision = decision["chosen"], decision["reason"]
        self.since_check = 0
        self.current = self.chosen
        return self.chosen, decision["reason"]

    # ---------------------------------------------------------------- guarding
    def guard_verdict(self, mean_loss: float | None, gap: float | None, nonfinite: float,
                      gradients: dict | None = None) -> str | None:
        """Why to fall back after a guard check of a window (its mean finite loss, loss gap and non-finite
        losses, :func:`window_summary`; ``gradients``: its :func:`gradient_summary`), or None. Counts the
        checks in a row beyond ``tolerance``."""
        if nonfinite and MODES[self.current].reduced:
            return f"non-finite loss in {int(nonfinite)} steps since the last check"
        best = self.best_loss
        if mean_loss is not None and 0 < best < math.inf and mean_loss > self.explode_factor * best:
            return (f"exploding loss: window mean {mean_loss:.4g} > {self.explode_factor:g} x lowest "
                    f"{self.best_loss:.4g}")
        gap_off = gap is not None and gap > self.tolerance
        grad_off = (gradients is not None and MODES[self.current].reduced
                    and gradient_verdict(gradients, self.grad_tolerance) is not None)
        if gap is None and not grad_off:
            return None
        if gap_off or grad_off:
            self.drift_strikes += 1
            if self.drift_strikes >= self.drift_patience:
                if gap_off:
                    return (f"loss gap {gap:.4g} > tolerance {self.tolerance:g} at {self.drift_strikes} "
                            "checks in a row")
                return f"{gradient_verdict(gradients, self.grad_tolerance)} at {self.drift_strikes} checks in a row"
        else:
            self.drift_strikes = 0
        return None

    def checked(self, mean_loss: float | None, verdict: str | None) -> None:
        """A guard check is over (every rank): the lowest window mean moves down when nothing failed."""
        self.since_check = 0
        if self.phase == GUARDING and mean_loss is not None and mean_loss > 0 and verdict is None:
            self.best_loss = min(self.best_loss, mean_loss)

    def fall_back(self, mode: str, reason: str, step: int) -> str | None:
        """Reject ``mode`` for ``reason`` (at optimizer step ``step``): the next safer mode not rejected, or
        None when there is none left (then training goes on in ``mode``)."""
        target = self.safer_mode(mode)
        if target is None:
            return None
        self.rejected[mode] = f"fell back: {reason}"
        if mode in self.profiles:
            self.profiles[mode]["status"] = f"fell back at step {step}: {reason}"
        self.drift_strikes = 0
        self.since_check = 0
        self.current = target
        return target

    def safer_mode(self, mode: str) -> str | None:
        code = MODES[mode].code
        safer = [m for m in self.plan if MODES[m].code < code and m not in self.rejected]
        return max(safer, key=lambda m: MODES[m].code) if safer else None

    # ---------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        return {
            "plan": list(self.plan), "phase": self.phase, "current": self.current, "chosen": self.chosen,
            "decision": self.decision, "profiles": self.profiles, "rejected": dict(self.rejected),
            "local_profiles": dict(self.local_profiles), "profile_index": self.profile_index,
            "round": list(self.round), "profile_rounds": self.profile_rounds, "best_loss": self.best_loss,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Carry on from :meth:`state_dict` (after :meth:`plan_for`); a ``ValueError`` when the checkpoint
        comes from another fixed mode or another plan."""
        if self.fixed_mode is not None or state.get("phase") == FIXED:
            if state.get("current") not in (None, self.fixed_mode):
                raise ValueError(f"the checkpoint was trained in fixed mode {state.get('current')!r}, this "
                                 f"PrecisionSwitch is fixed to {self.fixed_mode!r}")
            return
        if list(state.get("plan", [])) != self.plan:
            raise ValueError(f"the checkpoint profiled modes {state.get('plan')}, this PrecisionSwitch would "
                             f"profile {self.plan}; resume with the same candidates")
        self.phase = state["phase"]
        self.current, self.chosen, self.decision = state["current"], state["chosen"], state.get("decision")
        self.profiles, self.rejected = dict(state["profiles"]), dict(state["rejected"])
        self.local_profiles, self.profile_index = dict(state["local_profiles"]), int(state["profile_index"])
        self.round = list(state.get("round", self.plan))
        self.profile_rounds = int(state.get("profile_rounds", 0))
        self.best_loss = float(state["best_loss"])


# -------------------------------------------------------------------- windows and profiles
def window_summary(stats: Sequence[float]) -> tuple[float | None, float | None, int]:
    """(loss gap, mean finite loss, non-finite losses) of a window's statistics (None: nothing to measure)."""
    mean_loss = stats[LOSS_SUM] / stats[LOSS_N] if stats[LOSS_N] else None
    return loss_gap(stats), mean_loss, int(stats[NONFINITE])


def loss_gap(stats: Sequence[float]) -> float | None:
    """The relative loss gap of the probed steps of ``stats``: ``|sum(loss - ref)| / |sum(ref)|`` (None: none)."""
    if not stats[GAP_N]:
        return None
    diff, ref = abs(stats[DIFF_SUM]), abs(stats[REF_SUM])
    return diff / ref if ref > 0 else (0.0 if diff == 0 else math.inf)


def add_profile(total: dict | None, part: dict) -> dict:
    """A mode's local profile over rounds: the steps of both, statistics summed, the first failure."""
    if total is None:
        return {**part, "stats": padded(part["stats"])}
    return {"per_step": total["per_step"] + part["per_step"],
            "stats": [x + y for x, y in zip(padded(total["stats"]), padded(part["stats"]))],
            "failure": total["failure"] or part["failure"]}


def padded(stats: Sequence[float]) -> list[float]:
    """``stats`` with zeros for fields a checkpoint of an older version did not have."""
    return [*stats, *[0.0] * (N_STATS - len(stats))]


def mean_and_se(values: list[float]) -> tuple[float | None, float | None]:
    """The mean and its standard error (None with fewer than two values)."""
    if not values:
        return None, None
    mean = math.fsum(values) / len(values)
    if len(values) < 2:
        return mean, None
    variance = math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance / len(values))


def round_order(modes: Sequence[str], aa_pair: bool = True) -> list[str]:
    """The windows of a profiling round: the reference first and, with ``aa_pair`` when other modes are
    profiled, once more at the end (an A/A pair: what the same mode shows against itself is the noise floor
    of a pick; the pair also brackets the others in time, so a steady drift cancels in its mean)."""
    others = [m for m in modes if m != REFERENCE_MODE]
    if not aa_pair or REFERENCE_MODE not in modes or not others:
        return list(modes)
    return [REFERENCE_MODE, *others, REFERENCE_MODE]


def aa_floor(by_window: dict[tuple[int, int], list[list[float]]]) -> dict:
    """The noise floor from A/A pairs (two windows of one mode in one round): the relative standard deviation
    of a window's mean energy and time per step, ``sqrt(sum(d**2) / (2 * pairs))`` with ``d`` the relative
    difference of a pair's means (None without a pair). It holds what the per-step spread misses: a machine
    whose speed changes from one window to the next."""
    rounds: dict[int, list[tuple[float, float]]] = {}
    for (profile_round, _), steps in sorted(by_window.items()):
        rounds.setdefault(profile_round, []).append((math.fsum(v[0] for v in steps) / len(steps),
                                                     math.fsum(v[1] for v in steps) / len(steps)))
    pairs = [means[:2] for means in rounds.values() if len(means) >= 2]
    out: dict = {"aa_pairs": len(pairs), "window_J_rel_sd": None, "window_s_rel_sd": None}
    for column, key in ((0, "window_J_rel_sd"), (1, "window_s_rel_sd")):
        diffs = [(a[column] - b[column]) / ((a[column] + b[column]) / 2) for a, b in pairs
                 if a[column] + b[column] > 0]
        if diffs:
            out[key] = math.sqrt(math.fsum(d * d for d in diffs) / (2 * len(diffs)))
    return out


def merge_profiles(per_rank: list[dict[str, dict]], plan: list[str]) -> dict[str, dict]:
    """One row per profiled mode from every rank's local profile.

    Per profiled step (Lightning's step number): J summed over ranks, s of the slowest rank; the row holds
    their means over the steps (``step_J``, ``step_s``), the standard errors of those means (``step_J_se``,
    ``step_s_se``; None below two steps), the same from the means of the profiling rounds
    (``step_J_round_se``, ``step_s_round_se``; None below two rounds: the noise of a machine whose load
    changes from one round to the next, which the steps of one round do not show) and the loss statistics
    summed over ranks."""
    rows: dict[str, dict] = {}
    for name in plan:
        parts = [p[name] for p in per_rank if name in p]
        if not parts:
            continue
        stats = [sum(padded(p["stats"])[i] for p in parts) for i in range(N_STATS)]
        by_step: dict[int, list[float]] = {}
        for part in parts:
            for step, joules, seconds, profile_round, *window in part["per_step"]:
                merged = by_step.setdefault(int(step), [0.0, 0.0, profile_round, window[0] if window else 0])
                merged[0] += joules
                merged[1] = max(merged[1], seconds)
        step_J, step_J_se = mean_and_se([v[0] for v in by_step.values()])
        step_s, step_s_se = mean_and_se([v[1] for v in by_step.values()])
        by_round: dict[int, list[list[float]]] = {}
        by_window: dict[tuple[int, int], list[list[float]]] = {}
        for joules, seconds, profile_round, window in by_step.values():
            by_round.setdefault(int(profile_round), []).append([joules, seconds])
            by_window.setdefault((int(profile_round), int(window)), []).append([joules, seconds])
        round_J = [math.fsum(v[0] for v in steps) / len(steps) for steps in by_round.values()]
        round_s = [math.fsum(v[1] for v in steps) / len(steps) for steps in by_round.values()]
        failure = next((p["failure"] for p in parts if p["failure"]), None)
        rows[name] = {
            "mode": name,
            "code": MODES[name].code,
            "steps": len(by_step),
            "step_J": step_J,
            "step_s": step_s,
            "step_J_se": step_J_se,
            "step_s_se": step_s_se,
            "rounds": len(by_round),
            "step_J_round_se": mean_and_se(round_J)[1],
            "step_s_round_se": mean_and_se(round_s)[1],
            "windows": len(by_window),
            **aa_floor(by_window),
            "power_W": step_J / step_s if step_J is not None and step_s else None,
            "loss_gap": loss_gap(stats),
            "mean_loss": stats[LOSS_SUM] / stats[LOSS_N] if stats[LOSS_N] else None,
            "nonfinite_losses": int(stats[NONFINITE]),
            **gradient_summary(stats[GRAD_STATS:]),
            "failure": failure,
            "status": "",
        }
    return rows


# -------------------------------------------------------------------- the pick
def objective_of(row: dict, objective: str, floor: dict | None = None) -> tuple[float, float, float]:
    """(cost, standard error, degrees of freedom) of a row by ``objective``.

    The standard error is the largest of the one from the steps, the one from the round means and, with
    ``floor`` (the reference row's A/A noise floor, :func:`aa_floor`), the floor's relative standard
    deviation of one window over the square root of the row's windows (with the degrees of freedom of
    whichever is used: steps - 1, rounds - 1, A/A pairs). A row without ``*_se`` fields is exact (se 0);
    one whose standard error is unknown (fewer than two steps) has an infinite one."""
    steps, rounds = row.get("steps", math.inf), row.get("rounds", 1)
    windows = row.get("windows") or rounds

    def part(key: str) -> tuple[float, float, float]:
        value = row.get(key)
        if value is None:
            return math.inf, math.inf, 0
        se, dof = row.get(f"{key}_se", 0.0), steps - 1
        se = math.inf if se is None else se
        round_se = row.get(f"{key}_round_se")
        if round_se is not None and round_se > se:
            se, dof = round_se, rounds - 1
        relative_sd = (floor or {}).get(key.replace("step_", "window_") + "_rel_sd")
        if relative_sd is not None and relative_sd * abs(value) / math.sqrt(windows) > se:
            se, dof = relative_sd * abs(value) / math.sqrt(windows), floor["aa_pairs"]
        return value, se, dof

    energy, time_ = part("step_J"), part("step_s")
    if objective == "energy":
        return energy
    if objective == "time":
        return time_
    # edp = J * s; its standard error by the delta method
    cost = energy[0] * time_[0]
    se = math.hypot(time_[0] * energy[1], energy[0] * time_[1]) if math.isfinite(cost) else math.inf
    return cost, se, min(energy[2], time_[2])


def t_quantile(confidence: float, dof: float) -> float:
    """The two-sided Student-t quantile at ``confidence`` (normal for unbounded degrees of freedom)."""
    from scipy import stats  # lazily: only when a pick is due

    tail = (1.0 + confidence) / 2.0
    return float(stats.norm.ppf(tail) if not math.isfinite(dof) else stats.t.ppf(tail, max(dof, 1.0)))


def beyond_noise(a: tuple, b: tuple, confidence: float) -> bool:
    """True when two (cost, se, degrees of freedom) differ by more than the noise bound at ``confidence``."""
    (ca, sa, da), (cb, sb, db) = a, b
    if not (math.isfinite(ca) and math.isfinite(cb) and math.isfinite(sa) and math.isfinite(sb)):
        return False
    bound = t_quantile(confidence, min(da, db)) * math.hypot(sa, sb)
    return abs(ca - cb) > bound


def settle_mode(profiles: dict[str, dict], tolerance: float, objective: str, confidence: float = 0.95,
                final: bool = True, rounds: int = 1, min_rounds: int = 1,
                grad_tolerance: float = DEFAULT_GRAD_TOLERANCE) -> dict:
    """Pick a mode when the profiles settle it; fills each row's ``status``.

    Returns ``{"chosen": mode or None, "reason": str, "contenders": [modes]}``. ``chosen`` is a mode other
    than ``32-true`` only when that mode is cheaper than ``32-true`` by more than the noise bound (the
    safest such mode within noise of the cheapest one); None when the cheapest mode is within noise of
    ``32-true`` and this is not the ``final`` round (``contenders``: the modes within noise of the cheapest,
    to profile again); ``32-true`` when it is the cheapest or, in the final round, still within noise. Before
    a multiple of ``min_rounds`` rounds (and not ``final``) a mode other than ``32-true`` is not chosen yet:
    ``contenders`` are then the modes to profile once more to confirm it. A reduced mode whose gradients
    differ from float32's beyond ``grad_tolerance`` (:func:`gradient_verdict` of the row) is rejected.
    """
    eligible = {}
    for name, row in profiles.items():
        if row["failure"]:
            row["status"] = f"rejected: {row['failure']}"
        elif row["nonfinite_losses"] and MODES[name].reduced:
            row["status"] = f"rejected: {row['nonfinite_losses']} non-finite losses"
        elif name != REFERENCE_MODE and row["loss_gap"] is not None and row["loss_gap"] > tolerance:
            row["status"] = f"rejected: loss gap {row['loss_gap']:.4g} > tolerance {tolerance:g}"
        elif MODES[name].reduced and (verdict := gradient_verdict(row, grad_tolerance)) is not None:
            row["status"] = f"rejected: {verdict}"
        else:
            eligible[name] = row
    if objective == "energy" and not any(row["step_J"] for row in eligible.values()):
        objective = "time"  # no energy was measured
    floor = profiles.get(REFERENCE_MODE) if profiles.get(REFERENCE_MODE, {}).get("aa_pairs") else None
    cost = {name: objective_of(row, objective, floor) for name, row in eligible.items()}
    label = f"{objective} within tolerance {tolerance:g}"
    noise = f"{confidence:.0%} confidence, {rounds} round{'s' if rounds > 1 else ''}"
    contenders: list[str] = []
    if not eligible:
        chosen, reason = REFERENCE_MODE, "profiled: no mode eligible"
    else:
        best = min(eligible, key=lambda n: (cost[n][0], MODES[n].code))
        reference = cost.get(REFERENCE_MODE)
        contenders = [n for n in eligible if not beyond_noise(cost[n], cost[best], confidence)]
        if best == REFERENCE_MODE or reference is None:
            chosen, reason = best, f"profiled: cheapest by {label} ({noise})"
        elif beyond_noise(cost[best], reference, confidence):
            cheaper = [n for n in contenders if n != REFERENCE_MODE and cost[n][0] < reference[0]
                       and beyond_noise(cost[n], reference, confidence)]
            chosen = min(cheaper, key=lambda n: MODES[n].code)
            ratio = cost[chosen][0] / reference[0] if reference[0] > 0 else math.nan
            reason = (f"profiled: cheaper than {REFERENCE_MODE} beyond noise by {label} "
                      f"({ratio:.3g} x its cost; {noise})")
            if rounds % min_rounds and not final:
                contenders = [n for n in eligible if n in contenders or n == REFERENCE_MODE]
                chosen, reason = None, (f"{best} is cheaper than {REFERENCE_MODE} beyond noise by {objective} "
                                        f"({ratio:.3g} x; {noise}): confirming in another round, "
                                        f"{', '.join(contenders)}")
        elif not final:
            chosen, reason = None, (f"{best} is within noise of {REFERENCE_MODE} by {objective} ({noise}): "
                                    f"profiling {', '.join(contenders)} again")
        else:
            chosen, reason = REFERENCE_MODE, (f"profiled: no mode cheaper than {REFERENCE_MODE} beyond noise by "
                                              f"{label} ({noise}): keeps {REFERENCE_MODE}")
    for name, row in eligible.items():
        row["status"] = "chosen" if name == chosen else "eligible"
    return {"chosen": chosen, "reason": reason, "contenders": contenders}


def pick_mode(profiles: dict[str, dict], tolerance: float, objective: str,
              confidence: float = 0.95, grad_tolerance: float = DEFAULT_GRAD_TOLERANCE) -> tuple[str, str]:
    """The mode to train with once profiling is over, and why (:func:`settle_mode` in its final round)."""
    decision = settle_mode(profiles, tolerance, objective, confidence, final=True, grad_tolerance=grad_tolerance)
    return decision["chosen"], decision["reason"]


# -------------------------------------------------------------------- argument checks
def positive_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}")
    return float(value)


def int_at_least(name: str, value: Any, lowest: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"`{name}` must be an integer >= {lowest}, got {value!r}")
    return value


__all__ = [
    "DEFAULT_CANDIDATES", "OBJECTIVES", "N_STATS", "PrecisionPolicy", "merge_profiles", "pick_mode", "round_order",
    "settle_mode", "window_summary",
]
