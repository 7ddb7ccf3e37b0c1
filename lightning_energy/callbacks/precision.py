"""PrecisionSwitch: train in the cheapest numeric precision whose loss keeps up with float32, and guard it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_energy.measure import ranks as distributed
from lightning_energy.integration.base import MeteredCallback
from lightning_energy.integration.timeline import StepFigures
from lightning_energy.integration.precision_plugin import SwitchablePrecision
from lightning_energy.optimize.precision.modes import MODE_LEGEND, MODES, REFERENCE_MODE, get_mode, unavailable_reason
from lightning_energy.optimize.precision.probe import reference_loss
from lightning_energy.optimize.precision.report import (
    KEPT_CHECKS,
    REPORT_FILE,
    build_precision_report,
    format_precision_report,
)
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S
from lightning_energy.measure.sensors.base import Sensor

DEFAULT_CANDIDATES = ("32-true", "bf16-mixed", "16-mixed")
OBJECTIVES = ("energy", "time", "edp")
# window statistics, summed over steps and ranks: finite loss sum, finite losses, non-finite losses, and over
# the probed steps with both losses finite: sum of (loss - reference), sum of reference losses, their count
_LOSS_SUM, _LOSS_N, _NONFINITE, _DIFF_SUM, _REF_SUM, _GAP_N = range(6)
N_STATS = 6
PROBE = "precision_probe"  # the timeline's sub-window of the full-precision replay


class PrecisionSwitch(MeteredCallback):
    """Profile precision modes, train with the cheapest one whose loss stays within ``tolerance`` of float32.

    ``Trainer(callbacks=[EnergyCallback(), PrecisionSwitch(candidates=["32-true", "bf16-mixed", "16-mixed"])])``
    needs nothing else: when the Trainer has its default precision the callback installs a
    :class:`~lightning_energy.integration.precision_plugin.SwitchablePrecision` plugin (or uses one given in ``plugins``).

    1. Profiling, in rounds. In a round the reference ``32-true`` and then each candidate trains ``warmup_steps``
       + ``profile_steps`` optimizer steps. Over the profile steps the Trainer's timeline (the step windows every
       suite callback reads) gives energy and time of every step, so each mode has a mean per step and its
       standard error. Every mode is profiled under the same synchronisation: while profiling, ``32-true``
       steps pay the same per-step gradient check (one pass over the gradients, one host-device
       synchronisation) as the reduced modes do, but never skip a step. On every profiling step of a
       candidate the callback replays ``training_step`` on the same batch, weights and random numbers in
       ``32-true`` (under ``torch.no_grad``, logging silenced, buffers and torchmetrics states restored
       afterwards) and keeps the reference loss beside the step's. The replay is a named sub-window of the
       step (``precision_probe``): no step figure includes it, whatever the order of ``Trainer(callbacks=[...])``,
       and an EnergyCallback logs it apart as ``energy/extra/precision_probe_J`` and
       ``time/extra/precision_probe_s``. The loss gap of a set of probed steps is the relative gap of their
       summed losses, ``|sum(loss - reference)| / |sum(reference)|``.
    2. Pick, beyond the noise. Among the modes with no non-finite step and a gap <= ``tolerance``, a mode other
       than ``32-true`` is chosen only when it is cheaper by ``objective`` (energy per step, time per step, or
       their product) than ``32-true`` by more than the measurement noise: the difference of the means must
       exceed the two-sided Student-t bound at ``confidence`` of its standard error. While the cheapest mode
       is within noise of ``32-true``, another round profiles the modes within noise of the cheapest, up to
       ``max_profile_rounds`` rounds; after that ``32-true`` is kept. Of several modes beyond noise cheaper
       than ``32-true`` but within noise of each other, the safest (lowest code) is chosen. A mode other
       than ``32-true`` is chosen only at the end of a multiple of ``min_profile_rounds`` rounds (or of the last
       round), each round in the reverse order of the one before and the rounds pooled: on a machine whose load
       drifts, the mode profiled first can look cheaper by more than the per-step noise, in one order only;
       with two rounds (AB, BA) a steady drift cancels in the pool.
    3. Guard. Every ``check_every_n_steps`` steps the gap is measured again, over the last ``probe_batches``
       steps before the check (each replayed in ``32-true``). The callback falls back to the next
       safer mode (the order of :data:`~lightning_energy.integration.precision_plugin.MODE_NAMES`) on a non-finite gradient
       (the plugin skips that step, so parameters stay finite; with gradient scaling: ``max_consecutive_skips``
       skipped steps in a row), on an exploding loss (the window's mean loss above ``explode_factor`` times
       the lowest window mean so far; for positive losses) or when the gap exceeds ``tolerance`` at
       ``drift_patience`` checks in a row. A rejected mode is not used again in this fit. Non-finite losses
       in ``32-true`` or ``64-true`` have no safer mode to fall back to and are not caused by reduced
       precision: they are counted (``precision/nonfinite_losses``) and warned about once per mode, and
       training goes on in that mode (those modes step exactly as Lightning's own plugin does).

    With ``mode="bf16-mixed"`` (any mode, ``64-true`` included) the run stays in that mode: no profiling and
    no switching, but the gap is still measured and logged at every check, so sweeps can compare modes.
    Under DDP every rank computes the same statistics (summed over ranks) and rank 0's decision is broadcast,
    so all ranks switch together; energy per step is summed over ranks, time per step is the slowest rank's.

    Logged metrics:

    - ``precision/mode``: the mode of the training step as a number, at the Trainer's ``log_every_n_steps``:
      0 = 64-true, 1 = 32-true, 2 = tf32, 3 = bf16-mixed, 4 = 16-mixed (with gradient scaling),
      5 = 16-mixed-noscale (higher is less precise).
    - ``precision/<mode>/step_J``, ``precision/<mode>/step_s``, ``precision/<mode>/power_W``,
      ``precision/<mode>/loss_gap``: each profiled mode's energy per step (J, all ranks), time per step (s),
      mean power (W) and mean relative loss gap, logged once when profiling ends.
    - ``precision/loss_gap``: the relative loss gap to ``32-true`` at each check.
    - ``precision/switches``: the number of mode changes so far, logged at each change.
    - ``precision/skipped_steps``: optimizer steps skipped for non-finite gradients so far, at each check.
    - ``precision/nonfinite_losses``: non-finite training losses so far (summed over ranks), at each check.

    At the start of training every logger gets the hyperparameters ``precision/start_mode`` (the mode's
    name) and ``precision/mode_legend`` (the legend above), so that loggers without text can decode
    ``precision/mode``. With a TensorBoard logger the start ("step N: starts in a (reason)") and each mode
    change ("step N: a -> b (reason)") are also text entries ``precision/mode``. At the end of fit
    ``precision_report.json`` in the log dir holds a per-mode table (profiled energy and time per step, loss
    gap, status; optimizer steps, energy and time trained in each mode, the probes left out), the probes'
    own energy and time (``probe``), every switch with its reason and the legend; with ``verbose`` the
    table is printed. A full disk or a read-only log dir never fails the fit: a warning, ``report_path``
    None (EnergyCallback's ``energy_report.json`` carries the same table under ``sections``).

    Args:
        candidates: modes to choose from (default ``["32-true", "bf16-mixed", "16-mixed"]``). ``32-true`` is
            always profiled as the reference and is the last fallback. Modes the device lacks (``tf32`` off
            CUDA) are dropped with a warning. ``64-true`` cannot be switched to; use ``mode="64-true"``.
        tolerance: largest accepted relative loss gap to ``32-true`` (> 0).
        mode: a fixed mode instead of choosing (then leave ``candidates`` unset).
        warmup_steps: steps per profiled mode before measuring (>= 0).
        profile_steps: measured steps per profiled mode (>= 1).
        check_every_n_steps: steps between guard checks after profiling (0: no checks).
        probe_batches: steps replayed in ``32-true`` before each guard check (>= 1; every step when
            ``check_every_n_steps`` is smaller): the gap of a check is over all of them.
        confidence: confidence level of the noise bound a pick must beat (in (0, 1)).
        max_profile_rounds: most profiling rounds (>= 1); each later round profiles ``32-true`` and the modes
            within noise of the cheapest.
        min_profile_rounds: a mode other than ``32-true`` may be chosen after a multiple of this many rounds
            (>= 1; 2: after pairs of rounds in opposite orders).
        drift_patience: consecutive checks beyond ``tolerance`` before falling back (>= 1).
        explode_factor: the loss counts as exploding above this multiple of the lowest window mean (> 1).
        max_consecutive_skips: with gradient scaling, skipped steps in a row that count as a failure (>= 1).
        objective: ``"energy"`` (J per step), ``"time"`` (s per step) or ``"edp"`` (their product).
        probe: replay ``training_step`` in ``32-true`` to measure the loss gap (turn off when
            ``training_step`` has side effects that must not happen twice; then only non-finite steps and
            exploding losses are guarded against).
        sensors, backend, interval_s: as for ``EnergyCallback`` (used only when no EnergyCallback is in the
            Trainer; otherwise its sensors are shared).
        verbose: print the per-mode table at the end of fit (rank zero).
    """

    def __init__(
        self,
        candidates: Sequence[str] | None = None,
        tolerance: float = 0.02,
        mode: str | None = None,
        warmup_steps: int = 5,
        profile_steps: int = 20,
        check_every_n_steps: int = 50,
        probe_batches: int = 4,
        confidence: float = 0.95,
        max_profile_rounds: int = 4,
        min_profile_rounds: int = 2,
        drift_patience: int = 2,
        explode_factor: float = 10.0,
        max_consecutive_skips: int = 10,
        objective: str = "energy",
        probe: bool = True,
        sensors: list[Sensor] | None = None,
        backend: str = "auto",
        interval_s: float = DEFAULT_INTERVAL_S,
        verbose: bool = True,
    ) -> None:
        super().__init__()
        if mode is not None and candidates is not None:
            raise ValueError("give either `mode` (a fixed mode) or `candidates` (modes to choose from), not both")
        self.mode = None if mode is None else get_mode(mode, "mode").name
        if candidates is None:
            candidates = DEFAULT_CANDIDATES
        if isinstance(candidates, str) or not isinstance(candidates, Sequence) or not candidates:
            raise ValueError(f"`candidates` must be a non-empty list of mode names, got {candidates!r}")
        for name in candidates:
            if get_mode(name, "candidates").param_dtype != torch.float32:
                raise ValueError(
                    f"`candidates` cannot contain {name!r}: changing the parameters' dtype mid-run is not supported; "
                    f"use PrecisionSwitch(mode={name!r}) to train in it from the start"
                )
        if len(set(candidates)) != len(candidates):
            raise ValueError(f"`candidates` has duplicates: {list(candidates)}")
        self.candidates = list(candidates)
        self.tolerance = _positive_float("tolerance", tolerance)
        self.explode_factor = _positive_float("explode_factor", explode_factor)
        if self.explode_factor <= 1:
            raise ValueError(f"`explode_factor` must be > 1, got {explode_factor!r}")
        self.warmup_steps = _int_at_least("warmup_steps", warmup_steps, 0)
        self.profile_steps = _int_at_least("profile_steps", profile_steps, 1)
        self.check_every_n_steps = _int_at_least("check_every_n_steps", check_every_n_steps, 0)
        self.probe_batches = _int_at_least("probe_batches", probe_batches, 1)
        if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
            raise ValueError(f"`confidence` must be a number in (0, 1), got {confidence!r}")
        self.confidence = float(confidence)
        self.max_profile_rounds = _int_at_least("max_profile_rounds", max_profile_rounds, 1)
        self.min_profile_rounds = _int_at_least("min_profile_rounds", min_profile_rounds, 1)
        self.drift_patience = _int_at_least("drift_patience", drift_patience, 1)
        self.max_consecutive_skips = _int_at_least("max_consecutive_skips", max_consecutive_skips, 1)
        if objective not in OBJECTIVES:
            raise ValueError(f"`objective` must be one of {OBJECTIVES}, got {objective!r}")
        self.objective = objective
        self.check_flags(probe=probe, verbose=verbose)
        self.probe = probe
        self.verbose = verbose
        self._user_sensors = self.check_sensors(sensors, backend)
        self.backend = backend
        self.interval_s = self.check_interval(interval_s)
        self.plugin: SwitchablePrecision | None = None
        self.report: dict | None = None
        self.report_path: Path | None = None
        self._restored: dict | None = None
        self._reset_run_state()

    # ---------------------------------------------------------------- state of one fit
    def _reset_run_state(self) -> None:
        self.plan: list[str] = [self.mode] if self.mode else []
        self.phase = "fixed" if self.mode else "profiling"
        self.current: str | None = self.mode
        self.chosen: str | None = self.mode
        self.decision: str | None = "fixed mode" if self.mode else None  # why ``chosen`` was chosen
        self.profiles: dict[str, dict] = {}  # merged over ranks once profiling ends: the per-mode table
        self.rejected: dict[str, str] = {}  # mode -> reason
        self.switches: list[dict] = []
        self.checks: list[dict] = []  # the latest KEPT_CHECKS guard checks
        self.checks_total = 0
        self.nonfinite_losses = 0  # non-finite training losses seen at checks and in profiles, all ranks
        self._local_profiles: dict[str, dict] = {}
        self._round: list[str] = list(self.plan)  # the modes profiled in this round, in order
        self.profile_rounds = 0  # rounds finished
        self._profile_index = 0
        self._steps_in_mode = 0
        self._best_loss = math.inf
        self._drift_strikes = 0
        self._since_check = 0
        self._window: _LossWindow | None = None
        self._batch_mode: str | None = None
        self._ref_loss: torch.Tensor | None = None
        # per optimizer step (Lightning's step number, the one its StepFigures carry), tagged at its first
        # batch: (the mode it runs in, the mode whose profile it counts in or None, the profiling round); the
        # figures arrive a few steps later and are summed per mode
        self._step_tags: dict[int, tuple[str, str | None]] = {}
        self._step_begun: int | None = None
        self._profile_steps: dict[str, list] = {}  # mode -> [step, J, s, round] of its profile steps (this rank)
        self._trained: dict[str, _Sums] = {}  # mode -> every step trained in it (this rank)
        self._probes = _Sums()  # the steps with a probe: the probes' own energy and time (this rank)
        self._skips_before = 0
        self._warned: set[str] = set()
        self._estimated = False
        self._report_built = False

    # ---------------------------------------------------------------- set-up and tear-down
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if sum(isinstance(c, PrecisionSwitch) for c in trainer.callbacks) > 1:
            raise ValueError("a Trainer can hold only one PrecisionSwitch callback")
        plugin = self._install_plugin(trainer)
        device_type = trainer.strategy.root_device.type
        plugin.device_type = device_type
        if self.mode is not None:
            if reason := unavailable_reason(MODES[self.mode], device_type):
                raise ValueError(f"PrecisionSwitch(mode={self.mode!r}) cannot run on {device_type!r}: {reason}")
            plugin.request_mode(self.mode)
        if stage != "fit" or self.attachment is not None:
            return
        self._reset_run_state()
        if self.mode is None:
            self.plan = self._available_plan(device_type)
            self._round = list(self.plan)
            plugin.request_mode(REFERENCE_MODE)  # the model is set up (and checked) in float32
        self._probe_enabled = self.probe and pl_module.automatic_optimization and self.mode != "64-true"
        if self.probe and not pl_module.automatic_optimization:
            rank_zero_warn("PrecisionSwitch: manual optimization, so the loss gap is not measured (probe off); "
                           "only non-finite steps and exploding losses are guarded against.")
        attachment = self.attach(trainer, self._user_sensors, self.backend, self.interval_s)
        self._names = attachment.sensor_names  # this callback's sensors: the figures carry every sensor's
        self._estimated = any(getattr(s, "estimated", False) for s in attachment.sensors)
        self._log_dir = Path(trainer.log_dir or trainer.default_root_dir)

    def _install_plugin(self, trainer: Trainer) -> SwitchablePrecision:
        current = trainer.strategy.precision_plugin
        if isinstance(current, SwitchablePrecision):
            self.plugin = current
        elif type(current) is Precision:
            self.plugin = SwitchablePrecision()
            trainer.strategy.precision_plugin = self.plugin
        else:
            raise ValueError(
                f"PrecisionSwitch sets the precision itself, but the Trainer was built with precision="
                f"{trainer.precision!r} ({type(current).__name__}); remove Trainer(precision=...) or pass "
                "plugins=[SwitchablePrecision()] (single-device and DDP strategies; FSDP, DeepSpeed and XLA bring "
                "precision plugins of their own)"
            )
        return self.plugin

    def _available_plan(self, device_type: str) -> list[str]:
        plan = [REFERENCE_MODE]
        for name in self.candidates:
            if name == REFERENCE_MODE:
                continue
            if reason := unavailable_reason(MODES[name], device_type):
                rank_zero_warn(f"PrecisionSwitch: candidate {name!r} dropped: {reason}")
                self.rejected[name] = f"unavailable: {reason}"
                continue
            plan.append(name)
        return plan

    # ---------------------------------------------------------------- training
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._restored:
            self._apply_restored(self._restored)
            self._restored = None
        if self.phase == "profiling":
            self._steps_in_mode = 0
            self.plugin.check_reference_steps = True  # every mode profiled under the same synchronisation
            self._request(self._round[self._profile_index])
        elif self.current is not None:
            self._request(self.current)
        self._skips_before = self.plugin.skipped_steps
        self._window = _LossWindow(trainer.strategy.root_device)
        self._announce_start(trainer)

    def _announce_start(self, trainer: Trainer) -> None:
        """The starting mode: hyperparameters for every logger, a text entry for TensorBoard."""
        mode = self.plugin.pending_mode or self.plugin.mode_name
        if self.phase == "fixed":
            reason = "fixed mode"
        elif self.phase == "profiling":
            reason = f"profiling {self._profile_index + 1}/{len(self._round)}"
        else:
            reason = f"resumed; {self.decision}" if self.decision else "resumed"
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_hyperparams({"precision/start_mode": mode, "precision/mode_legend": MODE_LEGEND})
        self._mode_text(trainer, f"step {trainer.global_step}: starts in {mode} ({reason})")

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # the timeline has opened this step's window (MeteredCallback reports the boundary first)
        self._batch_mode = self.plugin.mode_name
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        if step != self._step_begun:  # the step's first batch (more follow with gradient accumulation)
            self._step_begun = step
            self._step_tags[step] = (self._batch_mode, self._profiled_mode(self._batch_mode), self.profile_rounds)
        self._ref_loss = None
        if self._probe_enabled and self._probe_due():
            with self.timeline.extra(PROBE):  # no step figure includes the replay; reported apart
                self._ref_loss = reference_loss(trainer, pl_module, self.plugin, batch, batch_idx)
        self._skips_before = self.plugin.skipped_steps

    def _profiled_mode(self, mode: str) -> str | None:
        """The mode whose profile a step now starting in ``mode`` counts in (past its warm-up), else None."""
        if self.phase != "profiling" or mode != self._round[self._profile_index]:
            return None
        return mode if self._steps_in_mode >= self.warmup_steps else None

    def _probe_due(self) -> bool:
        if self._batch_mode == REFERENCE_MODE:
            return False
        if self.phase == "profiling":
            return self._batch_mode == self._round[self._profile_index]
        # the last ``probe_batches`` steps before each check
        return self.check_every_n_steps > 0 and self._since_check >= self.check_every_n_steps - self.probe_batches

    @override
    def on_step_measured(self, trainer: Trainer, figures: StepFigures) -> None:
        """A step's figures (a few steps after it, the probe excluded): summed per mode and per profile."""
        tag = self._step_tags.pop(figures.step, None)
        if tag is None:
            return
        mode, profiled, profile_round = tag
        m = figures.measurement
        joules = sum(m.energy_J.get(name, 0.0) for name in self._names)
        self._trained.setdefault(mode, _Sums()).add(joules, m.duration_s)
        if profiled is not None:
            self._profile_steps.setdefault(profiled, []).append([figures.step, joules, m.duration_s, profile_round])
        probe = figures.extras.get(PROBE)
        if probe is not None:
            self._probes.add(sum(probe.energy_J.get(name, 0.0) for name in self._names), probe.duration_s)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch: Any,
                           batch_idx: int) -> None:
        self._accumulate(trainer, outputs)
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return  # the optimizer steps at a later batch: the step goes on
        mode = self._batch_mode
        if trainer._logger_connector.should_update_logs:
            self._log(trainer, {"precision/mode": float(MODES[mode].code)})
        failure = self._step_failure(mode)
        if self.phase == "profiling":
            self._profiling_step(trainer, mode, failure)
        elif self.phase == "guarding" and failure is not None:
            self._fall_back(trainer, mode, failure)
        else:
            if failure is not None and self.phase == "fixed":
                self._warn_once(f"fixed:{failure[:20]}", f"PrecisionSwitch(mode={mode!r}): {failure}")
            self._since_check += 1
            if self.check_every_n_steps and self._since_check >= self.check_every_n_steps:
                self._check(trainer)

    def _accumulate(self, trainer: Trainer, outputs) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            loss = loss.detach() * trainer.accumulate_grad_batches  # undo Lightning's division
            self._window.add(loss, self._ref_loss)

    def _step_failure(self, mode: str) -> str | None:
        """A non-finite step in ``mode`` (the same on every rank: gradients are all-reduced)."""
        plugin = self.plugin
        if plugin.skipped_steps <= self._skips_before:
            return None
        if MODES[mode].grad_scaling:
            if plugin.consecutive_skips >= self.max_consecutive_skips:
                return f"gradient scaler skipped {plugin.consecutive_skips} steps in a row (non-finite gradients)"
            return None
        return "non-finite gradients (optimizer step skipped)"

    # ---------------------------------------------------------------- profiling
    def _profiling_step(self, trainer: Trainer, mode: str, failure: str | None) -> None:
        target = self._round[self._profile_index]
        if mode != target:  # a deferred switch (gradient accumulation) has not happened yet
            return
        self._steps_in_mode += 1  # past the warm-up, the step was tagged for the profile at its start
        done = self._steps_in_mode >= self.warmup_steps + self.profile_steps
        if failure is None and not done:
            return
        self._local_profiles[target] = _add_profile(self._local_profiles.get(target),
                                                    self._finish_local_profile(trainer, target, failure))
        self._profile_index += 1
        self._steps_in_mode = 0
        if self._profile_index < len(self._round):
            self._switch(trainer, self._round[self._profile_index], self._profiling_reason())
        else:
            self._end_round(trainer)

    def _profiling_reason(self) -> str:
        text = f"profiling {self._profile_index + 1}/{len(self._round)}"
        return text + (f", round {self.profile_rounds + 1}" if self.profile_rounds else "")

    def _finish_local_profile(self, trainer: Trainer, mode: str, failure: str | None) -> dict:
        # the decision is due now, at the end of the profile's last step, whose figures usually arrive a few
        # steps later: wait (bounded) until the samples cover this moment, then have them all delivered
        self.attachment.meter.wait(self.timeline.mark())
        self.timeline.flush(trainer)
        return {"per_step": self._profile_steps.pop(mode, []), "stats": self._window.take().tolist(),
                "failure": failure}

    def _end_round(self, trainer: Trainer) -> None:
        """Pick, or profile the modes within noise of the cheapest once more (every rank, together)."""
        self.profile_rounds += 1
        gathered = distributed.gather(trainer, self._local_profiles)
        decision = None
        if trainer.is_global_zero:
            profiles = merge_profiles(gathered, self.plan)
            final = self.profile_rounds >= self.max_profile_rounds
            decision = settle_mode(profiles, self.tolerance, self.objective, self.confidence, final,
                                   self.profile_rounds, self.min_profile_rounds)
            decision["profiles"] = profiles
        decision = trainer.strategy.broadcast(decision, src=0)
        if decision["chosen"] is None:
            self._round = [m for m in self.plan if m in decision["contenders"]]
            if self.profile_rounds % 2:  # every other round in reverse order: load drift cancels in the pool
                self._round.reverse()
            self._profile_index = 0
            rank_zero_info(f"PrecisionSwitch: {decision['reason']}")
            self._switch(trainer, self._round[0], self._profiling_reason())
            return
        self._decide(trainer, decision)

    def _decide(self, trainer: Trainer, decision: dict) -> None:
        self.plugin.check_reference_steps = False  # profiling is over: 32-true steps as Lightning's own plugin
        self.profiles = decision["profiles"]
        for name, row in self.profiles.items():
            if row["status"].startswith("rejected"):
                self.rejected[name] = row["status"]
            self.nonfinite_losses += row["nonfinite_losses"]
            if row["nonfinite_losses"] and not MODES[name].reduced:
                self._warn_unguarded_nonfinite(name, row["nonfinite_losses"], "while profiling")
        means = [row["mean_loss"] for row in self.profiles.values() if row["mean_loss"] is not None]
        self._best_loss = min(means, default=math.inf)
        self.phase = "guarding"
        self.chosen, self.decision = decision["chosen"], decision["reason"]
        self._since_check = 0
        metrics = {"precision/nonfinite_losses": float(self.nonfinite_losses)}
        for name, row in self.profiles.items():
            for key, metric in (("step_J", "step_J"), ("step_s", "step_s"), ("power_W", "power_W"),
                                ("loss_gap", "loss_gap"), ("step_J_se", "step_J_se"), ("step_s_se", "step_s_se")):
                if row[key] is not None:
                    metrics[f"precision/{name}/{metric}"] = row[key]
        self._log(trainer, metrics)
        self._switch(trainer, self.chosen, decision["reason"])

    # ---------------------------------------------------------------- guarding
    def _check(self, trainer: Trainer) -> None:
        self._since_check = 0
        stats = trainer.strategy.reduce(self._window.take(), reduce_op="sum").tolist()
        gap = _gap(stats)
        mean_loss = stats[_LOSS_SUM] / stats[_LOSS_N] if stats[_LOSS_N] else None
        nonfinite = int(stats[_NONFINITE])
        self.nonfinite_losses += nonfinite
        metrics = {"precision/skipped_steps": float(self.plugin.skipped_steps),
                   "precision/nonfinite_losses": float(self.nonfinite_losses)}
        if gap is not None:
            metrics["precision/loss_gap"] = gap
        self._log(trainer, metrics)
        step = trainer.global_step
        self.checks.append({"step": step, "mode": self.current, "loss_gap": gap, "mean_loss": mean_loss,
                            "nonfinite_losses": nonfinite})
        if nonfinite and not MODES[self.current].reduced:
            self._warn_unguarded_nonfinite(self.current, nonfinite, f"in the {self.check_every_n_steps} steps "
                                                                    f"before step {step}")
        self.checks_total += 1
        if len(self.checks) > KEPT_CHECKS:
            del self.checks[0]
        if self.phase != "guarding":
            return
        verdict = None
        if trainer.is_global_zero:
            verdict = self._guard_verdict(mean_loss, gap, stats[_NONFINITE])
        verdict = trainer.strategy.broadcast(verdict, src=0)
        if mean_loss is not None and mean_loss > 0 and verdict is None:
            self._best_loss = min(self._best_loss, mean_loss)
        if verdict is not None:
            self._fall_back(trainer, self.current, verdict)

    def _warn_unguarded_nonfinite(self, mode: str, count: int, when: str) -> None:
        """Non-finite losses in a mode with nothing safer to fall back to: warn once per mode, train on."""
        self._warn_once(
            f"nonfinite:{mode}",
            f"PrecisionSwitch: {count} non-finite training losses {when} in {mode!r}, which is not a reduced "
            "precision: there is no safer mode to fall back to, so training goes on in it (check the learning "
            "rate, the data and the model; the count is logged as precision/nonfinite_losses)",
        )

    def _guard_verdict(self, mean_loss: float | None, gap: float | None, nonfinite: float) -> str | None:
        if nonfinite and MODES[self.current].reduced:
            return f"non-finite loss in {int(nonfinite)} steps since the last check"
        best = self._best_loss
        if mean_loss is not None and 0 < best < math.inf and mean_loss > self.explode_factor * best:
            return (f"exploding loss: window mean {mean_loss:.4g} > {self.explode_factor:g} x lowest "
                    f"{self._best_loss:.4g}")
        if gap is None:
            return None
        if gap > self.tolerance:
            self._drift_strikes += 1
            if self._drift_strikes >= self.drift_patience:
                return (f"loss gap {gap:.4g} > tolerance {self.tolerance:g} at {self._drift_strikes} "
                        "checks in a row")
        else:
            self._drift_strikes = 0
        return None

    def _fall_back(self, trainer: Trainer, mode: str, reason: str) -> None:
        target = self._safer_mode(mode)
        if target is None:
            self._warn_once(f"nothing-safer:{mode}", f"PrecisionSwitch: {reason} in {mode!r}, and no safer mode is "
                                                      "left to fall back to; training goes on in it")
            return
        self.rejected[mode] = f"fell back: {reason}"
        if mode in self.profiles:
            self.profiles[mode]["status"] = f"fell back at step {trainer.global_step}: {reason}"
        self._drift_strikes = 0
        self._since_check = 0
        self._window.take()
        self._switch(trainer, target, f"fallback: {reason}")

    def _safer_mode(self, mode: str) -> str | None:
        code = MODES[mode].code
        safer = [m for m in self.plan if MODES[m].code < code and m not in self.rejected]
        return max(safer, key=lambda m: MODES[m].code) if safer else None

    # ---------------------------------------------------------------- switching and logging
    def _request(self, mode: str) -> None:
        self.plugin.request_mode(mode)

    def _switch(self, trainer: Trainer, mode: str, reason: str) -> None:
        previous = self.plugin.mode_name
        self.current = mode
        self._request(mode)
        if previous == mode:
            return
        event = {"step": trainer.global_step, "epoch": trainer.current_epoch, "from": previous, "to": mode,
                 "reason": reason}
        self.switches.append(event)
        self._log(trainer, {"precision/switches": float(len(self.switches))})
        text = f"step {event['step']}: {previous} -> {mode} ({reason})"
        rank_zero_info(f"PrecisionSwitch: {text}")
        self._mode_text(trainer, text)

    def _mode_text(self, trainer: Trainer, text: str) -> None:
        """A ``precision/mode`` text entry for each TensorBoard logger (rank zero)."""
        if trainer.is_global_zero:
            from lightning.pytorch.loggers import TensorBoardLogger

            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_text("precision/mode", text, global_step=_log_step(trainer))

    def _log(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.log_metrics(trainer, metrics, _log_step(trainer))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    # ---------------------------------------------------------------- report
    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._build_report(trainer):
            return
        # a full disk or a read-only log dir never fails the fit: the writer warns, report_path stays None
        self.report_path = self.write_output(self._log_dir / REPORT_FILE, self.report)
        if self.verbose:
            where = self.report_path or "not written (see the warning)"
            print(format_precision_report(self.report) + f"\nreport: {where}", flush=True)
        elif self.report_path is not None:
            rank_zero_info(f"PrecisionSwitch: report written to {self.report_path}")

    def energy_report_section(self, trainer: Trainer) -> dict:
        """The per-mode table for EnergyCallback's ``energy_report.json`` (called on every rank)."""
        return {"precision": self.report} if self._build_report(trainer) else {}

    def _build_report(self, trainer: Trainer) -> bool:
        """Build ``self.report`` once per fit (collective: every rank calls it); True on rank zero."""
        if not self._report_built:
            self._report_built = True
            # the timeline has delivered every step's figures before any on_fit_end body runs
            trained = {mode: t.as_dict() for mode, t in self._trained.items()}
            gathered = distributed.gather(trainer, (trained, self._probes.as_dict()))
            if trainer.is_global_zero:
                self.report = build_precision_report(
                    fixed_mode=self.mode, plan=self.plan, tolerance=self.tolerance, objective=self.objective,
                    chosen=self.chosen, decision=self.decision, final_mode=self.plugin.mode_name, phase=self.phase,
                    profiles=self.profiles, rejected=self.rejected, trained_per_rank=[g[0] for g in gathered],
                    probes_per_rank=[g[1] for g in gathered],
                    switches=self.switches, checks=self.checks, checks_total=self.checks_total,
                    skipped_steps=self.plugin.skipped_steps, nonfinite_losses=self.nonfinite_losses,
                    estimated=self._estimated, confidence=None if self.mode else self.confidence,
                    profile_rounds=self.profile_rounds, probe_batches=self.probe_batches,
                )
        return trainer.is_global_zero

    # ---------------------------------------------------------------- resume
    @override
    def state_dict(self) -> dict[str, Any]:
        if self._window is None:
            return dict(self._restored or {})
        return {
            "plan": list(self.plan), "phase": self.phase, "current": self.current, "chosen": self.chosen,
            "decision": self.decision, "profiles": self.profiles, "rejected": dict(self.rejected),
            "switches": list(self.switches),
            "local_profiles": dict(self._local_profiles), "profile_index": self._profile_index,
            "round": list(self._round), "profile_rounds": self.profile_rounds,
            "best_loss": self._best_loss, "checks": list(self.checks), "checks_total": self.checks_total,
            "nonfinite_losses": self.nonfinite_losses,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)

    def _apply_restored(self, state: dict[str, Any]) -> None:
        if self.mode is not None or state.get("phase") == "fixed":
            if state.get("current") not in (None, self.mode):
                raise ValueError(f"the checkpoint was trained in fixed mode {state.get('current')!r}, this "
                                 f"PrecisionSwitch is fixed to {self.mode!r}")
            self.switches = list(state.get("switches", []))
            self.checks, self.checks_total = list(state.get("checks", [])), int(state.get("checks_total", 0))
            self.nonfinite_losses = int(state.get("nonfinite_losses", 0))
            return
        if list(state.get("plan", [])) != self.plan:
            raise ValueError(f"the checkpoint profiled modes {state.get('plan')}, this PrecisionSwitch would "
                             f"profile {self.plan}; resume with the same candidates")
        self.phase = state["phase"]
        self.current, self.chosen, self.decision = state["current"], state["chosen"], state.get("decision")
        self.profiles, self.rejected = dict(state["profiles"]), dict(state["rejected"])
        self.switches, self.checks = list(state["switches"]), list(state.get("checks", []))
        self.checks_total = int(state.get("checks_total", len(self.checks)))
        self._local_profiles, self._profile_index = dict(state["local_profiles"]), int(state["profile_index"])
        self._round = list(state.get("round", self.plan))
        self.profile_rounds = int(state.get("profile_rounds", 0))
        self._best_loss = float(state["best_loss"])
        self.nonfinite_losses = int(state.get("nonfinite_losses", 0))


class _Sums:
    """Energy (J, this callback's sensors) and time (s) of steps, summed."""

    __slots__ = ("steps", "energy_J", "seconds")

    def __init__(self) -> None:
        self.steps, self.energy_J, self.seconds = 0, 0.0, 0.0

    def add(self, joules: float, seconds: float) -> None:
        self.steps += 1
        self.energy_J += joules
        self.seconds += seconds

    def as_dict(self) -> dict:
        return {"steps": self.steps, "energy_J": self.energy_J, "seconds": self.seconds}


class _LossWindow:
    """Training losses (and probe references) since the last check, kept on the device: no synchronisation per step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.losses: list[torch.Tensor] = []
        self.pairs: list[torch.Tensor] = []  # (loss, reference) of the probed steps

    def add(self, loss: torch.Tensor, reference: torch.Tensor | None) -> None:
        self.losses.append(loss)
        if reference is not None:
            self.pairs.append(torch.stack((loss.double(), reference.double())))

    def take(self) -> torch.Tensor:
        """The window's statistics (see ``_LOSS_SUM`` ... ``_GAP_N``) as a float64 tensor on the device, and a
        fresh window."""
        stats = torch.zeros(N_STATS, dtype=torch.float64, device=self.device)
        if self.losses:
            losses = torch.stack(self.losses).double()
            finite = torch.isfinite(losses)
            stats[_LOSS_SUM] = losses[finite].sum()
            stats[_LOSS_N] = finite.sum()
            stats[_NONFINITE] = (~finite).sum()
        if self.pairs:
            pairs = torch.stack(self.pairs)
            both = torch.isfinite(pairs).all(dim=1)
            stats[_DIFF_SUM] = (pairs[both, 0] - pairs[both, 1]).sum()
            stats[_REF_SUM] = pairs[both, 1].sum()
            stats[_GAP_N] = both.sum()
        self.losses, self.pairs = [], []
        return stats


def _gap(stats: Sequence[float]) -> float | None:
    """The relative loss gap of the probed steps of ``stats``: ``|sum(loss - ref)| / |sum(ref)|`` (None: none)."""
    if not stats[_GAP_N]:
        return None
    diff, ref = abs(stats[_DIFF_SUM]), abs(stats[_REF_SUM])
    return diff / ref if ref > 0 else (0.0 if diff == 0 else math.inf)


def _add_profile(total: dict | None, part: dict) -> dict:
    """A mode's local profile over rounds: the steps of both, statistics summed, the first failure."""
    if total is None:
        return part
    return {"per_step": total["per_step"] + part["per_step"],
            "stats": [x + y for x, y in zip(total["stats"], part["stats"])],
            "failure": total["failure"] or part["failure"]}


def _mean_and_se(values: list[float]) -> tuple[float | None, float | None]:
    """The mean and its standard error (None with fewer than two values)."""
    if not values:
        return None, None
    mean = math.fsum(values) / len(values)
    if len(values) < 2:
        return mean, None
    variance = math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance / len(values))


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
        stats = [sum(p["stats"][i] for p in parts) for i in range(N_STATS)]
        by_step: dict[int, list[float]] = {}
        for part in parts:
            for step, joules, seconds, profile_round in part["per_step"]:
                merged = by_step.setdefault(int(step), [0.0, 0.0, profile_round])
                merged[0] += joules
                merged[1] = max(merged[1], seconds)
        step_J, step_J_se = _mean_and_se([v[0] for v in by_step.values()])
        step_s, step_s_se = _mean_and_se([v[1] for v in by_step.values()])
        by_round: dict[int, list[list[float]]] = {}
        for joules, seconds, profile_round in by_step.values():
            by_round.setdefault(int(profile_round), []).append([joules, seconds])
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
            "step_J_round_se": _mean_and_se(round_J)[1],
            "step_s_round_se": _mean_and_se(round_s)[1],
            "power_W": step_J / step_s if step_J is not None and step_s else None,
            "loss_gap": _gap(stats),
            "mean_loss": stats[_LOSS_SUM] / stats[_LOSS_N] if stats[_LOSS_N] else None,
            "nonfinite_losses": int(stats[_NONFINITE]),
            "failure": failure,
            "status": "",
        }
    return rows


def _objective_of(row: dict, objective: str) -> tuple[float, float, float]:
    """(cost, standard error, degrees of freedom) of a row by ``objective``.

    The standard error is the larger of the one from the steps and the one from the round means (with
    the degrees of freedom of whichever is used). A row without ``*_se`` fields is exact (se 0); one whose
    standard error is unknown (fewer than two steps) has an infinite one."""
    steps, rounds = row.get("steps", math.inf), row.get("rounds", 1)

    def part(key: str) -> tuple[float, float, float]:
        value = row.get(key)
        if value is None:
            return math.inf, math.inf, 0
        se, dof = row.get(f"{key}_se", 0.0), steps - 1
        se = math.inf if se is None else se
        round_se = row.get(f"{key}_round_se")
        if round_se is not None and round_se > se:
            se, dof = round_se, rounds - 1
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


def _t_quantile(confidence: float, dof: float) -> float:
    """The two-sided Student-t quantile at ``confidence`` (normal for unbounded degrees of freedom)."""
    from scipy import stats  # lazily: only when a pick is due

    tail = (1.0 + confidence) / 2.0
    return float(stats.norm.ppf(tail) if not math.isfinite(dof) else stats.t.ppf(tail, max(dof, 1.0)))


def _beyond_noise(a: tuple, b: tuple, confidence: float) -> bool:
    """True when two (cost, se, degrees of freedom) differ by more than the noise bound at ``confidence``."""
    (ca, sa, da), (cb, sb, db) = a, b
    if not (math.isfinite(ca) and math.isfinite(cb) and math.isfinite(sa) and math.isfinite(sb)):
        return False
    bound = _t_quantile(confidence, min(da, db)) * math.hypot(sa, sb)
    return abs(ca - cb) > bound


def settle_mode(profiles: dict[str, dict], tolerance: float, objective: str, confidence: float = 0.95,
                final: bool = True, rounds: int = 1, min_rounds: int = 1) -> dict:
    """Pick a mode when the profiles settle it; fills each row's ``status``.

    Returns ``{"chosen": mode or None, "reason": str, "contenders": [modes]}``. ``chosen`` is a mode other
    than ``32-true`` only when that mode is cheaper than ``32-true`` by more than the noise bound (the
    safest such mode within noise of the cheapest one); None when the cheapest mode is within noise of
    ``32-true`` and this is not the ``final`` round (``contenders``: the modes within noise of the cheapest,
    to profile again); ``32-true`` when it is the cheapest or, in the final round, still within noise. Before
    a multiple of ``min_rounds`` rounds (and not ``final``) a mode other than ``32-true`` is not chosen yet:
    ``contenders`` are then the modes to profile once more to confirm it.
    """
    eligible = {}
    for name, row in profiles.items():
        if row["failure"]:
            row["status"] = f"rejected: {row['failure']}"
        elif row["nonfinite_losses"] and MODES[name].reduced:
            row["status"] = f"rejected: {row['nonfinite_losses']} non-finite losses"
        elif name != REFERENCE_MODE and row["loss_gap"] is not None and row["loss_gap"] > tolerance:
            row["status"] = f"rejected: loss gap {row['loss_gap']:.4g} > tolerance {tolerance:g}"
        else:
            eligible[name] = row
    if objective == "energy" and not any(row["step_J"] for row in eligible.values()):
        objective = "time"  # no energy was measured
    cost = {name: _objective_of(row, objective) for name, row in eligible.items()}
    label = f"{objective} within tolerance {tolerance:g}"
    noise = f"{confidence:.0%} confidence, {rounds} round{'s' if rounds > 1 else ''}"
    contenders: list[str] = []
    if not eligible:
        chosen, reason = REFERENCE_MODE, "profiled: no mode eligible"
    else:
        best = min(eligible, key=lambda n: (cost[n][0], MODES[n].code))
        reference = cost.get(REFERENCE_MODE)
        contenders = [n for n in eligible if not _beyond_noise(cost[n], cost[best], confidence)]
        if best == REFERENCE_MODE or reference is None:
            chosen, reason = best, f"profiled: cheapest by {label} ({noise})"
        elif _beyond_noise(cost[best], reference, confidence):
            cheaper = [n for n in contenders if n != REFERENCE_MODE and cost[n][0] < reference[0]
                       and _beyond_noise(cost[n], reference, confidence)]
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
              confidence: float = 0.95) -> tuple[str, str]:
    """The mode to train with once profiling is over, and why (:func:`settle_mode` in its final round)."""
    decision = settle_mode(profiles, tolerance, objective, confidence, final=True)
    return decision["chosen"], decision["reason"]


def _log_step(trainer: Trainer) -> int:
    return getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)


def _positive_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}")
    return float(value)


def _int_at_least(name: str, value: Any, lowest: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"`{name}` must be an integer >= {lowest}, got {value!r}")
    return value


__all__ = ["PrecisionSwitch", "merge_profiles", "pick_mode", "settle_mode"]
