"""PrecisionSwitch: train in the cheapest numeric precision whose loss keeps up with float32, and guard it.

Thin glue: the Trainer's hooks feed a :class:`~lightning_energy.optimize.precision.policy.PrecisionPolicy`
(which decides: rounds, noise floor, pick, guard) with the step figures of the timeline and the loss
statistics of the steps, and the callback applies what it decides through the
:class:`~lightning_energy.integration.precision_plugin.SwitchablePrecision` plugin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_energy.extras import check_installed
from lightning_energy.integration.base import MeteredCallback, rank_zero_info_for
from lightning_energy.integration.precision_plugin import SwitchablePrecision
from lightning_energy.integration.lightning_internals import (
    batches_that_stepped,
    is_accumulating,
    optimizer_unscales_inside_step,
)
from lightning_energy.integration.timeline import StepFigures, should_log_step
from lightning_energy.measure import ranks as distributed
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.optimize.precision.gradients import DEFAULT_GRAD_TOLERANCE, compare_gradients, gradient_summary
from lightning_energy.optimize.precision.modes import MODE_LEGEND, MODES, REFERENCE_MODE, unavailable_reason
from lightning_energy.optimize.precision.policy import (
    CHECK,
    DEFAULT_CANDIDATES,
    DIFF_SUM,
    FALL_BACK,
    FIXED,
    GAP_N,
    GRAD_STATS,
    GUARDING,
    LOSS_N,
    LOSS_SUM,
    N_STATS,
    NONFINITE,
    OBJECTIVES,
    PROFILING,
    REF_SUM,
    WINDOW_DONE,
    PrecisionPolicy,
    merge_profiles,
    pick_mode,
    round_order,
    settle_mode,
    window_summary,
)
from lightning_energy.optimize.precision.probe import reference_step
from lightning_energy.provenance import combine, tagged
from lightning_energy.optimize.precision.report import (
    KEPT_CHECKS,
    REPORT_FILE,
    build_precision_report,
    format_precision_report,
)

PROBE = "precision_probe"  # the timeline's sub-window of the full-precision replay

log_info = rank_zero_info_for(__name__)

#: What the report table's ``code`` column (and the ``precision/mode`` metric) holds.
CODE_MEANING = f"the mode as a number, as logged in precision/mode ({MODE_LEGEND}; higher is less precise)"


class _FromPolicy:
    """A read-only attribute of the callback that is the policy's attribute ``name`` (its own name by default)."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, callback: Any, owner: type | None = None) -> Any:
        return self if callback is None else getattr(callback.policy, self.name)

    def __set__(self, callback: Any, value: Any) -> None:
        raise AttributeError(f"{self.name!r} is the policy's: set it on PrecisionSwitch(...) or callback.policy")


class PrecisionSwitch(MeteredCallback):
    """Profile precision modes, train with the cheapest one whose loss stays within ``tolerance`` of float32.

    ``Trainer(callbacks=[EnergyCallback(), PrecisionSwitch(candidates=["32-true", "bf16-mixed", "16-mixed"])])``
    needs nothing else: when the Trainer has its default precision the callback installs a
    :class:`~lightning_energy.integration.precision_plugin.SwitchablePrecision` plugin (or uses one given in ``plugins``).

    1. Profiling, in rounds. In a round the reference ``32-true``, then each candidate, then (``noise_floor``)
       ``32-true`` once more train ``warmup_steps`` + ``profile_steps`` optimizer steps each (a window); the two
       reference windows of a round are an A/A pair: what one mode shows against itself is the noise floor a
       pick must beat. Over the profile steps the Trainer's timeline (the step windows every
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
       summed losses, ``|sum(loss - reference)| / |sum(reference)|``. The replay also computes the float32
       gradient of the step (one more backward pass), and when the optimizer is handed the step's own
       gradient (after the scaler's unscale, before clipping) the two are compared: relative error of the
       gradient vector, cosine similarity (an SGD update's direction against float32's), norm ratio, share of
       elements that underflowed to zero, share of non-finite ones
       (:mod:`~lightning_energy.optimize.precision.gradients`). A loss can agree with float32 while the
       gradients do not (float16 without a scaler flushes gradients below 6e-8 to zero).
    2. Pick, beyond the noise. Among the modes with no non-finite step, a gap <= ``tolerance`` and a gradient
       error <= ``grad_tolerance``, a mode other
       than ``32-true`` is chosen only when it is cheaper by ``objective`` (energy per step, time per step, or
       their product) than ``32-true`` by more than the measurement noise: the difference of the means must
       exceed the two-sided Student-t bound at ``confidence`` of its standard error. That standard error is
       the largest of the per-step one, the one from the round means and the noise floor: the relative
       spread of one window's mean measured by the A/A pairs, over the square root of the mode's windows
       (degrees of freedom: the pairs). A machine whose speed changes from one window to the next (a CPU
       estimate on a shared VM) shows it there, where the per-step spread does not. While the cheapest mode
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
       the lowest window mean so far; for positive losses) or when the gap exceeds ``tolerance`` or the
       gradient error of the replayed steps exceeds ``grad_tolerance`` at
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
    - ``precision/grad_error``, ``precision/grad_cosine``: the gradient's relative error and cosine similarity
      against the float32 replay at each check (and ``precision/<mode>/grad_error`` once profiling ends).
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
        noise_floor: profile ``32-true`` again at the end of every round (an A/A pair) and require a pick to
            beat the noise floor the pairs measure (``False``: one ``32-true`` window a round, per-step and
            round-to-round noise only).
        drift_patience: consecutive checks beyond ``tolerance`` before falling back (>= 1).
        explode_factor: the loss counts as exploding above this multiple of the lowest window mean (> 1).
        max_consecutive_skips: with gradient scaling, skipped steps in a row that count as a failure (>= 1).
        objective: ``"energy"`` (J per step), ``"time"`` (s per step) or ``"edp"`` (their product).
        grad_tolerance: largest accepted relative error of the gradient the optimizer receives against a
            float32 replay of the step, ``sqrt(sum ||g - g32||^2 / sum ||g32||^2)`` over the replayed steps
            (> 0; default 0.25). Checked only on the steps the probe replays: the candidates' profiling
            windows and the ``probe_batches`` steps before each guard check.
        probe: replay ``training_step`` in ``32-true`` to measure the loss gap (turn off when
            ``training_step`` has side effects that must not happen twice; then only non-finite steps and
            exploding losses are guarded against).
        sensors, backend, interval_s: as for ``EnergyCallback`` (used only when no EnergyCallback is in the
            Trainer; otherwise its sensors are shared).
        verbose: print the per-mode table at the end of fit (rank zero).
    """


    mode = _FromPolicy("fixed_mode")
    candidates = _FromPolicy()
    tolerance = _FromPolicy()
    grad_tolerance = _FromPolicy()
    objective = _FromPolicy()
    confidence = _FromPolicy()
    check_every_n_steps = _FromPolicy()
    probe_batches = _FromPolicy()
    plan = _FromPolicy()
    phase = _FromPolicy()
    chosen = _FromPolicy()
    decision = _FromPolicy()
    profiles = _FromPolicy()
    rejected = _FromPolicy()
    profile_rounds = _FromPolicy()

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
        noise_floor: bool = True,
        drift_patience: int = 2,
        explode_factor: float = 10.0,
        max_consecutive_skips: int = 10,
        objective: str = "energy",
        grad_tolerance: float = DEFAULT_GRAD_TOLERANCE,
        probe: bool = True,
        sensors: list[Sensor] | None = None,
        backend: str = "auto",
        interval_s: float = DEFAULT_INTERVAL_S,
        verbose: bool = True,
    ) -> None:
        super().__init__()
        check_installed("scipy", "PrecisionSwitch")  # fail at construction, not in the middle of a fit
        self.policy = PrecisionPolicy(
            candidates=candidates, tolerance=tolerance, fixed_mode=mode, warmup_steps=warmup_steps,
            profile_steps=profile_steps, check_every_n_steps=check_every_n_steps, probe_batches=probe_batches,
            confidence=confidence, max_profile_rounds=max_profile_rounds, min_profile_rounds=min_profile_rounds,
            noise_floor=noise_floor, drift_patience=drift_patience, explode_factor=explode_factor,
            max_consecutive_skips=max_consecutive_skips, objective=objective, grad_tolerance=grad_tolerance,
        )
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
        self.policy.reset()
        self.switches: list[dict] = []
        self.checks: list[dict] = []  # the latest KEPT_CHECKS guard checks
        self.checks_total = 0
        self.nonfinite_losses = 0  # non-finite training losses seen at checks and in profiles, all ranks
        self._window: _LossWindow | None = None
        self._batch_mode: str | None = None
        self._ref_loss: torch.Tensor | None = None
        self._ref_grads: list[torch.Tensor | None] | None = None  # float32 gradients of the step being probed
        # per optimizer step (Lightning's step number, the one its StepFigures carry), tagged at its first
        # batch: (the mode it runs in, the mode whose profile it counts in or None, the profiling round, the
        # window); the figures arrive a few steps later and are summed per mode
        self._step_tags: dict[int, tuple[str, str | None, int, int]] = {}
        self._step_begun: int | None = None
        self._profile_steps: dict[str, list] = {}  # mode -> [step, J, s, round, window] of its profile steps
        self._trained: dict[str, _Sums] = {}  # mode -> every step trained in it (this rank)
        self._probes = _Sums()  # the steps with a probe: the probes' own energy and time (this rank)
        self._skips_before = 0
        self._warned: set[str] = set()
        self._estimated = False
        self._provenance = "measured"  # of this rank's sensors: measured / estimated / simulated, +-joined
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
            for name, reason in self.policy.plan_for(device_type).items():
                rank_zero_warn(f"PrecisionSwitch: candidate {name!r} dropped: {reason}")
            plugin.request_mode(REFERENCE_MODE)  # the model is set up (and checked) in float32
        self._probe_enabled = self.probe and pl_module.automatic_optimization and self.mode != "64-true"
        if self.probe and not pl_module.automatic_optimization:
            rank_zero_warn("PrecisionSwitch: manual optimization, so the loss gap is not measured (probe off); "
                           "only non-finite steps and exploding losses are guarded against.")
        attachment = self.attach(trainer, self._user_sensors, self.backend, self.interval_s)
        self._names = attachment.sensor_names  # this callback's sensors: the figures carry every sensor's
        self._estimated = any(getattr(s, "estimated", False) for s in attachment.sensors)
        self._provenance = combine(s.provenance for s in attachment.sensors)
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

    # ---------------------------------------------------------------- training
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._restored:
            self._apply_restored(self._restored)
            self._restored = None
        if self.phase == PROFILING:
            self.plugin.check_reference_steps = True  # every mode profiled under the same synchronisation
        if (mode := self.policy.start_mode()) is not None:
            self.plugin.request_mode(mode)
        self._skips_before = self.plugin.skipped_steps
        self._window = _LossWindow(trainer.strategy.root_device)
        self._announce_start(trainer)

    def _announce_start(self, trainer: Trainer) -> None:
        """The starting mode: hyperparameters for every logger, a text entry for TensorBoard."""
        mode = self.plugin.pending_mode or self.plugin.mode_name
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_hyperparams({"precision/start_mode": mode, "precision/mode_legend": MODE_LEGEND})
        self._mode_text(trainer, f"step {trainer.global_step}: starts in {mode} ({self.policy.start_reason()})")

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # the timeline has opened this step's window (MeteredCallback reports the boundary first)
        self._batch_mode = self.plugin.mode_name
        step = batches_that_stepped(trainer)
        if step != self._step_begun:  # the step's first batch (more follow with gradient accumulation)
            self._step_begun = step
            policy = self.policy
            self._step_tags[step] = (self._batch_mode, policy.profiled_mode(self._batch_mode), policy.profile_rounds,
                                     policy.profile_index)
            self._ref_grads = None
        self._ref_loss = None
        if self._probe_enabled and self.policy.probe_due(self._batch_mode):
            with self.timeline.extra(PROBE):  # no step figure includes the replay; reported apart
                self._ref_loss, grads = reference_step(trainer, pl_module, self.plugin, batch, batch_idx)
                self._add_reference_grads(grads, trainer.accumulate_grad_batches)
        self._skips_before = self.plugin.skipped_steps

    def _add_reference_grads(self, grads: list[torch.Tensor | None] | None, accumulated: int) -> None:
        """Sum the float32 gradients of a step's batches as Lightning sums the step's (each loss / accumulated)."""
        if grads is None:
            return
        grads = [None if g is None else g / accumulated for g in grads]
        if self._ref_grads is None:
            self._ref_grads = grads
        else:
            self._ref_grads = [a if b is None else b if a is None else a + b for a, b in zip(self._ref_grads, grads)]

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        """The gradient the optimizer is about to get (unscaled, not yet clipped) against the float32 replay's:
        only on replayed steps; statistics stay on the device (no host synchronisation but the scale's with an
        optimizer that unscales inside its step, and one all-reduce of the replay's gradients under DDP)."""
        reference, self._ref_grads = self._ref_grads, None
        if reference is None or self._window is None:
            return
        with self.timeline.extra(PROBE):  # the comparison is the probe's cost, not the step's
            params = [p for p in pl_module.parameters() if p.requires_grad]
            if trainer.world_size > 1:  # the step's gradients are the ranks' mean: so is the reference
                reference = _ranks_mean(trainer, reference, params)
            grads = [p.grad for p in params]
            scaler = self.plugin.scaler
            if scaler is not None and optimizer_unscales_inside_step(optimizer):
                inverse = 1.0 / scaler.get_scale()
                grads = [None if g is None else g * inverse for g in grads]
            self._window.add_gradients(compare_gradients(grads, reference))

    @override
    def on_step_measured(self, trainer: Trainer, figures: StepFigures) -> None:
        """A step's figures (a few steps after it, the probe excluded): summed per mode and per profile."""
        tag = self._step_tags.pop(figures.step, None)
        if tag is None:
            return
        mode, profiled, profile_round, window = tag
        m = figures.measurement
        joules = sum(m.energy_J.get(name, 0.0) for name in self._names)
        self._trained.setdefault(mode, _Sums()).add(joules, m.duration_s)
        if profiled is not None:
            self._profile_steps.setdefault(profiled, []).append([figures.step, joules, m.duration_s, profile_round,
                                                                 window])
        probe = figures.extras.get(PROBE)
        if probe is not None:
            self._probes.add(sum(probe.energy_J.get(name, 0.0) for name in self._names), probe.duration_s)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch: Any,
                           batch_idx: int) -> None:
        self._accumulate(trainer, outputs)
        if is_accumulating(trainer):
            return  # the optimizer steps at a later batch: the step goes on
        mode = self._batch_mode
        if should_log_step(trainer):
            self._log(trainer, {"precision/mode": float(MODES[mode].code)})
        plugin = self.plugin
        failure = self.policy.step_failure(mode, plugin.skipped_steps > self._skips_before, plugin.consecutive_skips)
        if failure is not None and self.phase == FIXED:
            self._warn_once(f"fixed:{failure[:20]}", f"PrecisionSwitch(mode={mode!r}): {failure}")
        action = self.policy.after_step(mode, failure)
        if action == WINDOW_DONE:
            self._window_done(trainer, failure)
        elif action == FALL_BACK:
            self._fall_back(trainer, mode, failure)
        elif action == CHECK:
            self._check(trainer)

    def _accumulate(self, trainer: Trainer, outputs) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            loss = loss.detach() * trainer.accumulate_grad_batches  # undo Lightning's division
            self._window.add(loss, self._ref_loss)

    # ---------------------------------------------------------------- profiling
    def _window_done(self, trainer: Trainer, failure: str | None) -> None:
        """A profiling window is over: hand its figures to the policy, go on to the next window or round."""
        # the decision is due now, at the end of the window's last step, whose figures usually arrive a few
        # steps later: wait (bounded) until the samples cover this moment, then have them all delivered
        self.attachment.meter.wait(self.timeline.mark())
        self.timeline.flush(trainer)
        target = self.policy.window_mode
        part = {"per_step": self._profile_steps.pop(target, []), "stats": self._window.take().tolist(),
                "failure": failure}
        following = self.policy.window_finished(part)
        if following is not None:
            self._switch(trainer, following, self.policy.profiling_reason())
            return
        # the round is over: rank zero settles it from every rank's profiles, every rank applies the decision
        gathered = distributed.gather(trainer, self.policy.local_profiles)
        decision = self.policy.settle(gathered) if trainer.is_global_zero else None
        decision = trainer.strategy.broadcast(decision, src=0)
        if decision["chosen"] is None:
            log_info(f"PrecisionSwitch: {decision['reason']}")
            self._switch(trainer, *self.policy.apply_round(decision))
            return
        mode, reason = self.policy.apply_round(decision)
        self.plugin.check_reference_steps = False  # profiling is over: 32-true steps as Lightning's own plugin
        metrics = {}
        for name, row in self.profiles.items():
            self.nonfinite_losses += row["nonfinite_losses"]
            if row["nonfinite_losses"] and not MODES[name].reduced:
                self._warn_unguarded_nonfinite(name, row["nonfinite_losses"], "while profiling")
            for key in ("step_J", "step_s", "power_W", "loss_gap", "step_J_se", "step_s_se", "grad_error",
                        "grad_cosine"):
                if row[key] is not None:
                    metrics[f"precision/{name}/{key}"] = row[key]
        self._log(trainer, {"precision/nonfinite_losses": float(self.nonfinite_losses), **metrics})
        self._switch(trainer, mode, reason)

    # ---------------------------------------------------------------- guarding
    def _check(self, trainer: Trainer) -> None:
        stats = trainer.strategy.reduce(self._window.take(), reduce_op="sum").tolist()
        gap, mean_loss, nonfinite = window_summary(stats)
        gradients = gradient_summary(stats[GRAD_STATS:])
        self.nonfinite_losses += nonfinite
        metrics = {"precision/skipped_steps": float(self.plugin.skipped_steps),
                   "precision/nonfinite_losses": float(self.nonfinite_losses)}
        if gap is not None:
            metrics["precision/loss_gap"] = gap
        for key in ("grad_error", "grad_cosine"):
            if gradients[key] is not None:
                metrics[f"precision/{key}"] = gradients[key]
        self._log(trainer, metrics)
        step = trainer.global_step
        current = self.policy.current
        self.checks.append({"step": step, "mode": current, "loss_gap": gap, "mean_loss": mean_loss,
                            "nonfinite_losses": nonfinite, **gradients})
        if nonfinite and not MODES[current].reduced:
            self._warn_unguarded_nonfinite(current, nonfinite, f"in the {self.check_every_n_steps} steps "
                                                               f"before step {step}")
        self.checks_total += 1
        if len(self.checks) > KEPT_CHECKS:
            del self.checks[0]
        if self.phase != GUARDING:
            self.policy.checked(mean_loss, None)
            return
        verdict = self.policy.guard_verdict(mean_loss, gap, nonfinite, gradients) if trainer.is_global_zero else None
        verdict = trainer.strategy.broadcast(verdict, src=0)
        self.policy.checked(mean_loss, verdict)
        if verdict is not None:
            self._fall_back(trainer, current, verdict)

    def _warn_unguarded_nonfinite(self, mode: str, count: int, when: str) -> None:
        """Non-finite losses in a mode with nothing safer to fall back to: warn once per mode, train on."""
        self._warn_once(
            f"nonfinite:{mode}",
            f"PrecisionSwitch: {count} non-finite training losses {when} in {mode!r}, which is not a reduced "
            "precision: there is no safer mode to fall back to, so training goes on in it (check the learning "
            "rate, the data and the model; the count is logged as precision/nonfinite_losses)",
        )

    def _fall_back(self, trainer: Trainer, mode: str, reason: str) -> None:
        target = self.policy.fall_back(mode, reason, trainer.global_step)
        if target is None:
            self._warn_once(f"nothing-safer:{mode}", f"PrecisionSwitch: {reason} in {mode!r}, and no safer mode is "
                                                      "left to fall back to; training goes on in it")
            return
        self._window.take()
        self._switch(trainer, target, f"fallback: {reason}")

    # ---------------------------------------------------------------- switching and logging
    def _switch(self, trainer: Trainer, mode: str, reason: str) -> None:
        previous = self.plugin.mode_name
        self.plugin.request_mode(mode)
        if previous == mode:
            return
        event = {"step": trainer.global_step, "epoch": trainer.current_epoch, "from": previous, "to": mode,
                 "reason": reason}
        self.switches.append(event)
        self._log(trainer, {"precision/switches": float(len(self.switches))})
        text = f"step {event['step']}: {previous} -> {mode} ({reason})"
        log_info(f"PrecisionSwitch: {text}")
        self._mode_text(trainer, text)

    def _mode_text(self, trainer: Trainer, text: str) -> None:
        """A ``precision/mode`` text entry for each TensorBoard logger (rank zero)."""
        if trainer.is_global_zero:
            from lightning.pytorch.loggers import TensorBoardLogger

            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_text("precision/mode", text, global_step=batches_that_stepped(trainer))

    def _log(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.log_metrics(trainer, metrics, batches_that_stepped(trainer))

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
            print(format_precision_report(self.report) + f"\n  code: {CODE_MEANING}\nreport: {where}", flush=True)
        log_info(self.summary_line())

    def summary_line(self) -> str:
        """The fit in one line (rank zero, once the report is built): the final mode, the energy trained in all
        modes (J, with its provenance) and per profiled step against ``32-true``, and where the report went."""
        report = self.report
        rows = {row["mode"]: row for row in report["modes"]}
        steps = sum(row["trained_steps"] for row in rows.values())
        energy = tagged(f"{sum(row['trained_J'] for row in rows.values()):.4g} J", self._provenance)
        how = ("fixed mode" if report["fixed_mode"] else f"chosen {report['chosen']}" if report["chosen"]
               else "nothing chosen: training ended while profiling")
        final = report["final_mode"]
        profiled = [name for name in (final, REFERENCE_MODE) if rows.get(name, {}).get("step_J") is not None]
        per_step = (" (profiled " + " vs ".join(f"{name} {rows[name]['step_J']:.4g} J/step" for name in profiled) + ")"
                    if len(profiled) == 2 and final != REFERENCE_MODE else "")
        switches = len(report["switches"])
        where = f"report written to {self.report_path}" if self.report_path else "report not written (see the warning)"
        return (f"PrecisionSwitch: final mode {final} ({how}), {energy} over {steps} trained steps{per_step}, "
                f"{switches} switch{'es' if switches != 1 else ''}; {where} (its column code: {CODE_MEANING})")

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
            **self.policy.state_dict(), "switches": list(self.switches), "checks": list(self.checks),
            "checks_total": self.checks_total, "nonfinite_losses": self.nonfinite_losses,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)

    def _apply_restored(self, state: dict[str, Any]) -> None:
        fixed = self.mode is not None or state.get("phase") == FIXED
        self.policy.load_state_dict(state)
        self.switches, self.checks = list(state.get("switches", [])), list(state.get("checks", []))
        self.checks_total = int(state.get("checks_total", 0 if fixed else len(self.checks)))
        self.nonfinite_losses = int(state.get("nonfinite_losses", 0))


def _ranks_mean(trainer: Trainer, grads: list[torch.Tensor | None], params: list) -> list[torch.Tensor]:
    """The ranks' mean of per-parameter gradients (one all-reduce of the flattened vector)."""
    full = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
    flat = trainer.strategy.reduce(torch.cat([g.reshape(-1) for g in full]), reduce_op="mean")
    out, offset = [], 0
    for g in full:
        out.append(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return out


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
    """Training losses (and probe references) since the last check, kept on the device: no synchronisation
    per step. :meth:`take` sums them into the policy's window statistics (``N_STATS``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.losses: list[torch.Tensor] = []
        self.pairs: list[torch.Tensor] = []  # (loss, reference) of the probed steps
        self.gradients: list[torch.Tensor] = []  # compare_gradients of the probed steps

    def add_gradients(self, stats: torch.Tensor) -> None:
        self.gradients.append(stats.to(self.device))

    def add(self, loss: torch.Tensor, reference: torch.Tensor | None) -> None:
        self.losses.append(loss)
        if reference is not None:
            self.pairs.append(torch.stack((loss.double(), reference.double())))

    def take(self) -> torch.Tensor:
        """The window's statistics (the layout of ``LOSS_SUM`` ... ``GAP_N`` in
        :mod:`~lightning_energy.optimize.precision.policy`) as a float64 tensor on the device, and a fresh window."""
        stats = torch.zeros(N_STATS, dtype=torch.float64, device=self.device)
        if self.losses:
            losses = torch.stack(self.losses).double()
            finite = torch.isfinite(losses)
            stats[LOSS_SUM] = losses[finite].sum()
            stats[LOSS_N] = finite.sum()
            stats[NONFINITE] = (~finite).sum()
        if self.pairs:
            pairs = torch.stack(self.pairs)
            both = torch.isfinite(pairs).all(dim=1)
            stats[DIFF_SUM] = (pairs[both, 0] - pairs[both, 1]).sum()
            stats[REF_SUM] = pairs[both, 1].sum()
            stats[GAP_N] = both.sum()
        if self.gradients:
            stats[GRAD_STATS:] = torch.stack(self.gradients).sum(dim=0)
        self.losses, self.pairs, self.gradients = [], [], []
        return stats


# the decision rules live in the policy; re-exported here, where they were before
__all__ = ["DEFAULT_CANDIDATES", "OBJECTIVES", "PrecisionSwitch", "merge_profiles", "pick_mode", "round_order",
           "settle_mode"]
