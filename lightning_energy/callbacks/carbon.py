"""CarbonCallback: grams of CO2e per epoch and in total, from the measured (or estimated) energy."""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_energy.extras import check_installed
from lightning_energy.measure import ranks as distributed
from lightning_energy.carbon import (
    CarbonIntensity, co2e_g, resolve_intensity, validate_pue,
)
from lightning_energy.integration.base import MeteredCallback, rank_zero_info_for
from lightning_energy.integration.lightning_internals import progress_bar_dict
from lightning_energy.integration.timeline import EpochFigures
from lightning_energy.measure.meter import measure
from lightning_energy.measure.sampler import DEFAULT_INTERVAL_S
from lightning_energy.measure.sensors.base import Sensor
from lightning_energy.measure.zeus_codecarbon_internals import codecarbon_tracker_started
from lightning_energy.units import G_PER_KG, J_PER_KWH

log_info = rank_zero_info_for(__name__)

CARBON_REPORT_FILE = "carbon_report.json"
PUBLISHED_NAME = "carbon"  # the intensity and PUE on the run's board (see the class docstring)


class CarbonCallback(MeteredCallback):
    """CO2e of training: energy (kWh) x carbon intensity (gCO2e/kWh) x PUE, per epoch and in total.

    The energy is read from the Trainer's timeline (the windows every suite callback reads) for this
    callback's sensors: those of an ``EnergyCallback`` in the same Trainer when ``sensors`` is None
    (wherever it is listed), else auto-detected or given. So it works alone and, beside an
    ``EnergyCallback`` with the same sensors, its totals are that callback's. Estimated energy (no
    sensor) gives estimated CO2e, flagged in the report.

    Logged metrics, through every Lightning logger at the epoch's step (a few steps after the epoch's
    end in a single process, when its figures arrive):

    - ``carbon/epoch_gCO2e``: one training epoch including its validation (epoch start to epoch
      end), summed over ranks.
    - ``carbon/total_gCO2e``: since fit start, summed over ranks, continuing across resumes.
    - progress bar: ``gCO2e`` (the total).

    At the end of fit ``carbon_report.json`` in the log dir holds the intensity and where it came
    from, the PUE, each epoch's energy (J) and CO2e (g), the totals and, with
    ``codecarbon_crosscheck=True``, CodeCarbon's own offline figures for the same fit beside ours.

    Other callbacks of the same Trainer (``CatalogCallback``, ``ForecastCallback``) find the intensity and
    PUE on the run's board (``session.published``, :class:`lightning_energy.core.published.Published`),
    published at setup under the name ``"carbon"`` as ``{"intensity": CarbonIntensity, "pue": float}``;
    they read it at fit start or later, when every callback's setup has run.

    Intensity: give at most one of ``intensity_g_per_kWh``, ``energy_mix`` or ``country_iso_code``
    (with an optional ``region``); with none, the world average of 475 g/kWh is used and labelled.
    Nothing is looked up over the network.

    Args:
        country_iso_code: 3-letter ISO code (``"FRA"``) for CodeCarbon's offline country figure.
        region: US state, Canadian or Chinese province, or Nordic bidding zone (``"SE3"``).
        intensity_g_per_kWh: the grid's intensity in gCO2e/kWh, if you know it.
        energy_mix: shares of sources summing to 1, e.g. ``{"nuclear": 0.7, "hydro": 0.3}``.
        pue: power usage effectiveness of the facility (>= 1).
        codecarbon_crosscheck: also run CodeCarbon's ``OfflineEmissionsTracker`` over the fit (rank
            zero; needs ``country_iso_code``; CodeCarbon runs its own measuring thread).
        sensors, backend, interval_s: as for ``EnergyCallback``; with ``sensors=None`` the sensors of an
            ``EnergyCallback`` in the same Trainer are read.
        verbose: print a one-line summary at the end of fit.
    """

    def __init__(
        self,
        country_iso_code: str | None = None,
        region: str | None = None,
        intensity_g_per_kWh: float | None = None,
        energy_mix: dict[str, float] | None = None,
        pue: float = 1.0,
        codecarbon_crosscheck: bool = False,
        sensors: list[Sensor] | None = None,
        backend: str = "auto",
        interval_s: float = DEFAULT_INTERVAL_S,
        verbose: bool = True,
    ) -> None:
        super().__init__()
        self.intensity: CarbonIntensity = resolve_intensity(country_iso_code, region, intensity_g_per_kWh, energy_mix)
        self.pue = validate_pue(pue)
        self.check_flags(codecarbon_crosscheck=codecarbon_crosscheck, verbose=verbose)
        if codecarbon_crosscheck and country_iso_code is None:
            raise ValueError("`codecarbon_crosscheck` needs `country_iso_code`: CodeCarbon's offline tracker "
                             "requires a country")
        if codecarbon_crosscheck:
            check_installed("codecarbon", "CarbonCallback(codecarbon_crosscheck=True)")
        self.configure_measurement(sensors, backend, interval_s)
        self.country_iso_code = country_iso_code
        self.region = region
        self.codecarbon_crosscheck = codecarbon_crosscheck
        self.verbose = verbose
        self.report: dict | None = None
        self.report_path: Path | None = None
        self._resumed: dict = {}
        self._final_state: dict | None = None
        self._trainer: Trainer | None = None
        self._tracker = None
        self._reset()

    def _reset(self) -> None:
        self._epochs: list[dict] = list(self._resumed.get("epochs", []))
        self._total_J = self._resumed.get("total_J", 0.0)
        self._estimated = False
        self._names: list[str] = []  # this rank's sensors
        self._all_names: list[str] = []  # every rank's (all-rank figures are per sensor name, summed over ranks)

    @property
    def g_per_J(self) -> float:
        """Grams of CO2e per joule of measured energy (intensity and PUE applied)."""
        return self.intensity.g_per_kWh * self.pue / J_PER_KWH

    def co2e_g(self, energy_J: float) -> float:
        """Grams of CO2e for ``energy_J`` joules with this callback's intensity and PUE."""
        return co2e_g(energy_J, self.intensity.g_per_kWh, self.pue)

    # ---------------------------------------------------------------- set-up and tear-down
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.attachment is not None:
            return
        self._resumed, self._final_state = {}, None  # a checkpoint's state, if any, arrives after setup
        self._reset()
        attachment = self.attach(trainer, self._user_sensors, self.backend, self.interval_s)
        attachment.session.published.publish(PUBLISHED_NAME, {"intensity": self.intensity, "pue": self.pue})
        self._names = self._all_names = attachment.sensor_names
        self._estimated = any(getattr(s, "estimated", False) for s in attachment.sensors)
        self._trainer = trainer
        self._log_dir = Path(trainer.log_dir or trainer.default_root_dir)
        if self.intensity.kind == "world_average":
            rank_zero_warn(f"lightning-energy: CO2e uses the {self.intensity.label}; give `country_iso_code`, "
                           "`intensity_g_per_kWh` or `energy_mix` for your grid")

    @override
    def release(self, trainer: Trainer, stage: str | None, exception: BaseException | None) -> None:
        if exception is not None:
            self._stop_tracker()
        self._trainer = None

    # ---------------------------------------------------------------- energy of this callback's sensors
    def _J(self, energy_J: dict[str, float]) -> float:
        """The energy of this callback's sensors (of every rank) in a figure's per-sensor dict (figures
        carry every sensor of the session)."""
        return sum(energy_J.get(name, 0.0) for name in self._all_names)

    def _since_fit_start(self, end_s: float) -> float:
        """This rank's J of this callback's sensors from the fit's start to ``end_s`` (sampler clock), from
        the samples at hand (extrapolated from the last power past the latest sample)."""
        start, sampler = self.timeline.fit_start, self.attachment.sampler
        if start.resolved:
            start_energy = start.energy
        else:  # a provisional epoch (checkpoint) within the fit's first sampling interval
            start_energy = sampler.energy_at(self._names, start.t if start.t is not None else end_s)[0]
        end_energy, _ = sampler.energy_at(self._names, end_s)
        return sum(end_energy[n] - start_energy[n] for n in self._names
                   if end_energy.get(n) is not None and start_energy.get(n) is not None)

    # ---------------------------------------------------------------- fit
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # collective, like on_fit_start on every rank: host sensors live on local rank 0, devices per rank
        self._all_names = sorted({n for rank in distributed.gather(trainer, self._names) for n in rank})
        if self.codecarbon_crosscheck and trainer.is_global_zero:
            self._tracker = _start_codecarbon(self.country_iso_code, self.region, self.pue, self._log_dir)

    @override
    def on_epoch_measured(self, trainer: Trainer, figures: EpochFigures) -> None:
        # all ranks' figures of one epoch; under DDP delivered at the epoch's end on every rank at once
        row = self._epoch_row(trainer, figures)
        self._epochs.append(row)
        self._total_J = row["total_J"]
        self.log_metrics(trainer, {"carbon/epoch_gCO2e": row["gCO2e"], "carbon/total_gCO2e": row["total_gCO2e"]},
                         figures.step)
        self._show_total(trainer, row["total_gCO2e"])

    def _epoch_row(self, trainer: Trainer, figures: EpochFigures, provisional: bool = False) -> dict:
        """The report's row of one epoch, validation included (the epoch's start to its end). Collective
        under DDP unless ``provisional`` (single process only)."""
        epoch_J = self._J(figures.energy_J) + sum(self._J(loop.energy_J) for loop in figures.validation)
        seconds = figures.duration_s + sum(loop.duration_s for loop in figures.validation)
        local_J = self._since_fit_start(figures.end_s)
        fit_J = local_J if provisional else sum(distributed.gather(trainer, local_J))
        total_J = self._resumed.get("total_J", 0.0) + fit_J
        row = {"epoch": figures.epoch, "energy_J": epoch_J, "duration_s": seconds, "gCO2e": self.co2e_g(epoch_J),
               "total_J": total_J, "total_gCO2e": self.co2e_g(total_J)}
        return {**row, "provisional": True} if provisional else row

    @staticmethod
    def _show_total(trainer: Trainer, grams: float) -> None:
        progress_bar_dict(trainer)["gCO2e"] = grams

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the timeline has delivered every epoch, and resolved its fit end, before this runs
        timeline = self.timeline
        fit = measure(timeline.fit_start, timeline.fit_end)
        session_J = sum(distributed.gather(trainer, self._J(fit.energy_J)))
        total_J = self._resumed.get("total_J", 0.0) + session_J
        self._final_state = {"total_J": total_J, "epochs": list(self._epochs)}  # for a checkpoint after the fit
        codecarbon = self._stop_tracker()
        if not trainer.is_global_zero:
            return
        self.report = {
            "intensity": self.intensity.as_dict(),
            "pue": self.pue,
            "estimated": self._estimated,
            "total_J": total_J,
            "total_kWh": total_J / J_PER_KWH,
            "total_gCO2e": self.co2e_g(total_J),
            "duration_s": fit.duration_s,
            "epochs": self._epochs,
            "resumed_total_J": self._resumed.get("total_J"),
            "codecarbon": codecarbon,
        }
        self.report_path = self.write_output(self._log_dir / CARBON_REPORT_FILE, self.report)
        message = (f"lightning-energy carbon: {self.report['total_gCO2e']:.4g} gCO2e for {total_J:.1f} J "
                   f"at {self.intensity.label}, PUE {self.pue:g}{' (ESTIMATED energy)' if self._estimated else ''}")
        if codecarbon is not None and "error" not in codecarbon:
            message += (f"; CodeCarbon: {codecarbon['gCO2e']:.4g} gCO2e for {codecarbon['energy_J']:.1f} J")
        if self.verbose:
            print(message, flush=True)
        else:
            log_info(message)

    def _stop_tracker(self) -> dict | None:
        tracker, self._tracker = self._tracker, None
        if tracker is None or isinstance(tracker, dict):  # a dict: the error that kept it from starting
            return tracker
        return _stop_codecarbon(tracker)

    # ---------------------------------------------------------------- resume
    @override
    def state_dict(self) -> dict[str, Any]:
        """The total since the first fit (all ranks, J) up to now and the epochs so far, for resume.

        Does not wait: the total reaches the latest samples (extrapolated by one sampling interval at
        most), and an epoch ended but not yet delivered (single process: a few steps after its end) is
        included as estimated from the samples at hand, marked ``provisional``. Collective under DDP, as
        Lightning saves checkpoints on every rank.
        """
        trainer, timeline = self._trainer, self.timeline
        if timeline is None or trainer is None or timeline.fit_start is None:
            return dict(self._final_state if self._final_state is not None else self._resumed)
        if timeline.fit_end is not None and self._final_state is not None:
            return dict(self._final_state)
        so_far = timeline.so_far(self._names)
        pending = [self._epoch_row(trainer, f, provisional=True) for f in so_far["pending_epochs"]]
        fit_J = sum(distributed.gather(trainer, so_far["fit_J"]))
        return {"total_J": self._resumed.get("total_J", 0.0) + fit_J, "epochs": list(self._epochs) + pending}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = dict(state_dict)
        self._epochs = list(self._resumed.get("epochs", []))
        self._total_J = self._resumed.get("total_J", 0.0)


def _start_codecarbon(country_iso_code: str, region: str | None, pue: float, log_dir: Path):
    """CodeCarbon's offline tracker, started; or a dict with the error (and a warning) if it did not start.

    Its import prints through amdsmi (silenced); its own warnings are silenced too, since CodeCarbon
    swallows exceptions in ``start`` and a warning turned into an error would leave it silently idle.
    """
    os.environ.setdefault("CODECARBON_LOG_LEVEL", "error")
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from codecarbon import OfflineEmissionsTracker

            tracker = OfflineEmissionsTracker(
                country_iso_code=country_iso_code.upper(), region=region, pue=pue, output_methods=[],
                log_level="error", allow_multiple_runs=True, output_dir=str(log_dir),
            )
            tracker.start()
    except Exception as err:  # the cross-check must never break the fit
        message = f"CodeCarbon's tracker could not start ({type(err).__name__}: {err})"
    else:
        if codecarbon_tracker_started(tracker):
            return tracker
        message = "CodeCarbon's tracker did not start (it swallowed an error; run it alone to see why)"
    rank_zero_warn(f"lightning-energy: {message}; no cross-check in the carbon report")
    return {"error": message}


def _stop_codecarbon(tracker) -> dict:
    """CodeCarbon's figures for its window, in our units (J, g); an error entry if it failed."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tracker.stop()
        data = tracker.final_emissions_data
    except Exception as err:  # the cross-check must never break the fit
        return {"error": f"{type(err).__name__}: {err}"}
    return {
        "energy_J": data.energy_consumed * J_PER_KWH,
        "gCO2e": data.emissions * G_PER_KG,
        "cpu_J": data.cpu_energy * J_PER_KWH,
        "gpu_J": data.gpu_energy * J_PER_KWH,
        "energy_includes_pue": True,  # CodeCarbon multiplies its energy by the PUE; ours is the bare energy
        "ram_J": data.ram_energy * J_PER_KWH,
        "duration_s": data.duration,
        # CodeCarbon multiplies its energy by the PUE, so its emissions per kWh are the bare grid intensity
        "intensity_g_per_kWh": data.emissions * G_PER_KG / data.energy_consumed if data.energy_consumed else None,
        "country_iso_code": data.country_iso_code,
        "region": data.region,
        "cpu_model": data.cpu_model,
        "gpu_model": data.gpu_model,
        "pue": data.pue,
        "tool": f"codecarbon {getattr(__import__('codecarbon'), '__version__', 'unknown')} OfflineEmissionsTracker",
    }
