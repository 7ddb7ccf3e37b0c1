"""CarbonCallback: grams of CO2e per epoch and in total, from the measured (or estimated) energy."""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_energy import distributed
from lightning_energy.carbon import (
    JOULES_PER_KWH, CarbonIntensity, co2e_g, resolve_intensity, validate_pue,
)
from lightning_energy.io import atomic_write_json
from lightning_energy.meter import Mark, measure
from lightning_energy.sampler import DEFAULT_INTERVAL_S, MIN_INTERVAL_S
from lightning_energy.sensors.base import Sensor, validate_sensors
from lightning_energy.sensors.detect import BACKENDS
from lightning_energy.session import MeterSession, open_meter_session

CARBON_REPORT_FILE = "carbon_report.json"


class CarbonCallback(Callback):
    """CO2e of training: energy (kWh) x carbon intensity (gCO2e/kWh) x PUE, per epoch and in total.

    The energy comes from this callback's own window on the shared meter (the sensors of an
    ``EnergyCallback`` in the same Trainer when there is one, else auto-detected or given), so it
    works alone and agrees with ``EnergyCallback`` when both are used. Estimated energy (no sensor)
    gives estimated CO2e, flagged in the report.

    Logged metrics:

    - ``carbon/epoch_gCO2e``: one training epoch including its validation (epoch start to epoch
      end), summed over ranks.
    - ``carbon/total_gCO2e``: since fit start, summed over ranks, continuing across resumes.
    - progress bar: ``gCO2e`` (the total).

    At the end of fit ``carbon_report.json`` in the log dir holds the intensity and where it came
    from, the PUE, each epoch's energy (J) and CO2e (g), the totals and, with
    ``codecarbon_crosscheck=True``, CodeCarbon's own offline figures for the same fit beside ours.

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
        sensors, backend, interval_s: as for ``EnergyCallback``; unused when an ``EnergyCallback`` listed
            before this callback in the Trainer is present (its sensors are shared).
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
        for flag, value in (("codecarbon_crosscheck", codecarbon_crosscheck), ("verbose", verbose)):
            if not isinstance(value, bool):
                raise TypeError(f"`{flag}` must be a bool, got {type(value).__name__}")
        if codecarbon_crosscheck and country_iso_code is None:
            raise ValueError("`codecarbon_crosscheck` needs `country_iso_code`: CodeCarbon's offline tracker "
                             "requires a country")
        self._user_sensors = None if sensors is None else validate_sensors(sensors)
        if backend not in BACKENDS:
            raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}")
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s >= MIN_INTERVAL_S:
            raise ValueError(f"`interval_s` must be a number >= {MIN_INTERVAL_S} s, got {interval_s!r}")
        self.country_iso_code = country_iso_code
        self.region = region
        self.codecarbon_crosscheck = codecarbon_crosscheck
        self.backend = backend
        self.interval_s = float(interval_s)
        self.verbose = verbose
        self.report: dict | None = None
        self.report_path: Path | None = None
        self._resumed: dict = {}
        self._session: MeterSession | None = None
        self._tracker = None
        self._reset()

    def _reset(self) -> None:
        self._fit_start: Mark | None = None
        self._epoch_start: Mark | None = None
        self._epochs: list[dict] = list(self._resumed.get("epochs", []))
        self._total_J = self._resumed.get("total_J", 0.0)
        self._estimated = False

    @property
    def g_per_J(self) -> float:
        """Grams of CO2e per joule of measured energy (intensity and PUE applied)."""
        return self.intensity.g_per_kWh * self.pue / JOULES_PER_KWH

    def co2e_g(self, energy_J: float) -> float:
        """Grams of CO2e for ``energy_J`` joules with this callback's intensity and PUE."""
        return co2e_g(energy_J, self.intensity.g_per_kWh, self.pue)

    # ---------------------------------------------------------------- set-up and tear-down
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._session is not None:
            return
        self._resumed = {}
        self._reset()
        self._session = open_meter_session(trainer, self, self._user_sensors, self.backend, self.interval_s)
        for note in self._session.notes:  # only when this callback detected sensors itself
            rank_zero_warn(note)
        self._estimated = any(getattr(s, "estimated", False) for s in self._session.sensors)
        self._log_dir = Path(trainer.log_dir or trainer.default_root_dir)
        if self.intensity.kind == "world_average":
            rank_zero_warn(f"lightning-energy: CO2e uses the {self.intensity.label}; give `country_iso_code`, "
                           "`intensity_g_per_kWh` or `energy_mix` for your grid")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop_tracker()
        self._release()

    def _release(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    # ---------------------------------------------------------------- fit
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.codecarbon_crosscheck and trainer.is_global_zero:
            self._tracker = _start_codecarbon(self.country_iso_code, self.region, self.pue, self._log_dir)
        meter = self._session.meter
        self._fit_start = meter.wait(meter.mark())

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_start = self._session.meter.mark()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        meter = self._session.meter
        end = meter.wait(meter.mark())
        window = measure(self._epoch_start, end)
        merged = distributed.merge(distributed.gather(trainer, {
            "epoch_J": window.total_J, "fit_J": measure(self._fit_start, end).total_J, "seconds": window.duration_s,
        }))
        epoch_J = merged["epoch_J"]
        self._total_J = self._resumed.get("total_J", 0.0) + merged["fit_J"]
        row = {"epoch": trainer.current_epoch, "energy_J": epoch_J, "duration_s": merged["seconds"],
               "gCO2e": self.co2e_g(epoch_J), "total_J": self._total_J, "total_gCO2e": self.co2e_g(self._total_J)}
        self._epochs.append(row)
        for name, value in (("carbon/epoch_gCO2e", row["gCO2e"]), ("carbon/total_gCO2e", row["total_gCO2e"])):
            pl_module.log(name, value, on_step=False, on_epoch=True, batch_size=1, rank_zero_only=True)
        pl_module.log("gCO2e", row["total_gCO2e"], prog_bar=True, logger=False, on_step=False, on_epoch=True,
                      batch_size=1, rank_zero_only=True)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        meter = self._session.meter
        end = meter.wait(meter.mark())
        fit = measure(self._fit_start, end)
        session_J = sum(distributed.gather(trainer, fit.total_J))
        codecarbon = self._stop_tracker()
        if not trainer.is_global_zero:
            return
        total_J = self._resumed.get("total_J", 0.0) + session_J
        self.report = {
            "intensity": self.intensity.as_dict(),
            "pue": self.pue,
            "estimated": self._estimated,
            "total_J": total_J,
            "total_kWh": total_J / JOULES_PER_KWH,
            "total_gCO2e": self.co2e_g(total_J),
            "duration_s": fit.duration_s,
            "epochs": self._epochs,
            "resumed_total_J": self._resumed.get("total_J"),
            "codecarbon": codecarbon,
        }
        self.report_path = atomic_write_json(self._log_dir / CARBON_REPORT_FILE, self.report)
        message = (f"lightning-energy carbon: {self.report['total_gCO2e']:.4g} gCO2e for {total_J:.1f} J "
                   f"at {self.intensity.label}, PUE {self.pue:g}{' (ESTIMATED energy)' if self._estimated else ''}")
        if codecarbon is not None and "error" not in codecarbon:
            message += (f"; CodeCarbon: {codecarbon['gCO2e']:.4g} gCO2e for {codecarbon['energy_J']:.1f} J")
        if self.verbose:
            print(message, flush=True)
        else:
            rank_zero_info(message)

    def _stop_tracker(self) -> dict | None:
        tracker, self._tracker = self._tracker, None
        if tracker is None or isinstance(tracker, dict):  # a dict: the error that kept it from starting
            return tracker
        return _stop_codecarbon(tracker)

    # ---------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        if not self._epochs:
            return dict(self._resumed)
        return {"total_J": self._total_J, "epochs": list(self._epochs)}

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
        if getattr(tracker, "_start_time", None) is not None:
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
        "energy_J": data.energy_consumed * JOULES_PER_KWH,
        "gCO2e": data.emissions * 1000.0,
        "cpu_J": data.cpu_energy * JOULES_PER_KWH,
        "gpu_J": data.gpu_energy * JOULES_PER_KWH,
        "energy_includes_pue": True,  # CodeCarbon multiplies its energy by the PUE; ours is the bare energy
        "ram_J": data.ram_energy * JOULES_PER_KWH,
        "duration_s": data.duration,
        # CodeCarbon multiplies its energy by the PUE, so its emissions per kWh are the bare grid intensity
        "intensity_g_per_kWh": data.emissions * 1000.0 / data.energy_consumed if data.energy_consumed else None,
        "country_iso_code": data.country_iso_code,
        "region": data.region,
        "cpu_model": data.cpu_model,
        "gpu_model": data.gpu_model,
        "pue": data.pue,
        "tool": f"codecarbon {getattr(__import__('codecarbon'), '__version__', 'unknown')} OfflineEmissionsTracker",
    }
