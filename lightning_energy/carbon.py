"""Carbon intensity (gCO2e/kWh) and CO2e of measured energy, offline only.

CO2e (g) = energy (kWh) x intensity (gCO2e/kWh) x PUE. The intensity comes from, in order of
preference: a figure the user gives, an energy mix the user gives (shares of sources, see
:func:`intensity_from_mix`), CodeCarbon's offline data for a country ISO code (and a region where
CodeCarbon has regional data: US states, Canadian provinces, Chinese provinces, Nordic bidding zones),
else the world average of 475 g/kWh, labelled as such. A country needs CodeCarbon's data (the ``carbon``
extra: :class:`~lightning_energy.extras.MissingExtra` without it). CodeCarbon's data files are read directly
(located with ``importlib.util.find_spec``), so codecarbon is never imported and nothing is looked up
over the network. (CodeCarbon's own data API, ``codecarbon.input.DataSource``, reads the same files, but
importing it costs ~0.4 s, its first call loads pandas and every table, ~0.9 s more, and the import prints
through amdsmi where ROCm is absent: ~2 ms here instead. Its ``Emissions.get_private_infra_emissions``
applies the same regional rules, but matches US states case-sensitively by name only, logs an error with a
traceback for an unknown region, and says nothing of where its figure came from, which the report shows.)
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from lightning_energy.extras import check_installed
from lightning_energy.units import G_PER_KG, J_PER_KWH

WORLD_AVERAGE_G_PER_KWH = 475.0  # CodeCarbon's world-average fallback (IEA 2019)
MIX_TOLERANCE = 1e-6  # shares must sum to 1 within this

# Life-cycle intensity per source, gCO2e/kWh (CodeCarbon's carbon_intensity_per_source.json, CONTEXT.md).
SOURCE_INTENSITY_G_PER_KWH: dict[str, float] = {
    "coal": 995.0,
    "petroleum": 816.0,
    "natural_gas": 743.0,
    "geothermal": 38.0,
    "hydro": 26.0,
    "nuclear": 29.0,
    "solar": 48.0,
    "wind": 26.0,
}

LBS_PER_MWH_TO_G_PER_KWH = 0.45359237  # 1 lb/MWh = 453.59237 g / 1000 kWh
# CodeCarbon's factors for Canadian provincial mixes (kg/kWh), from the energy-usage project.
_CANADA_SOURCE_KG_PER_KWH = {"coal": 0.995725971, "petroleum": 0.8166885263, "naturalGas": 0.7438415916}
_NORDIC_ZONES = {"SWE": {"SE1", "SE2", "SE3", "SE4"}, "NOR": {"NO1", "NO2", "NO3", "NO4", "NO5"}, "FIN": {"FI"}}
_CHINA_SUFFIX = re.compile(r"\s+(autonomous region|municipality|province|sheng|shi|zizhiqu)$")


@dataclass(frozen=True)
class CarbonIntensity:
    """A carbon intensity in gCO2e/kWh and where it came from.

    ``kind`` is one of ``"user"``, ``"mix"``, ``"country"``, ``"region"``, ``"world_average"``.
    """

    g_per_kWh: float
    kind: str
    label: str

    def as_dict(self) -> dict:
        return {"g_per_kWh": self.g_per_kWh, "kind": self.kind, "label": self.label}


def intensity_from_mix(mix: dict[str, float]) -> float:
    """Carbon intensity (gCO2e/kWh) of an electricity mix: sum of share x source intensity.

    ``mix`` maps sources (``coal``, ``petroleum``, ``natural_gas``, ``geothermal``, ``hydro``,
    ``nuclear``, ``solar``, ``wind``) to shares in [0, 1] that sum to 1 (within 1e-6).
    """
    if not isinstance(mix, dict) or not mix:
        raise ValueError(f"energy mix must be a non-empty dict of source -> share, got {mix!r}")
    unknown = sorted(str(k) for k in mix if k not in SOURCE_INTENSITY_G_PER_KWH)
    if unknown:
        raise ValueError(
            f"unknown energy source(s) {unknown} in the mix; known sources: {sorted(SOURCE_INTENSITY_G_PER_KWH)}"
        )
    for source, share in mix.items():
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(share):
            raise ValueError(f"share of {source!r} must be a finite number, got {share!r}")
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share of {source!r} must be in [0, 1], got {share}")
    total = math.fsum(mix.values())
    if abs(total - 1.0) > MIX_TOLERANCE:
        raise ValueError(f"energy mix shares must sum to 1 (within {MIX_TOLERANCE}), got {total!r}")
    return math.fsum(share * SOURCE_INTENSITY_G_PER_KWH[source] for source, share in mix.items())


def co2e_g(energy_J: float, g_per_kWh: float, pue: float = 1.0) -> float:
    """Grams of CO2e for ``energy_J`` joules at ``g_per_kWh`` and power usage effectiveness ``pue``."""
    return energy_J / J_PER_KWH * g_per_kWh * pue


def validate_pue(pue: object) -> float:
    """A data-centre PUE (total facility energy / IT energy): a finite number >= 1."""
    if isinstance(pue, bool) or not isinstance(pue, (int, float)) or not math.isfinite(pue) or pue < 1.0:
        raise ValueError(f"`pue` must be a number >= 1 (facility energy / IT energy), got {pue!r}")
    return float(pue)


def world_average(reason: str = "no location or intensity given") -> CarbonIntensity:
    return CarbonIntensity(WORLD_AVERAGE_G_PER_KWH, "world_average", f"world average 475 g/kWh ({reason})")


def resolve_intensity(
    country_iso_code: str | None = None,
    region: str | None = None,
    g_per_kWh: float | None = None,
    mix: dict[str, float] | None = None,
) -> CarbonIntensity:
    """The intensity from the user's figure, mix or location (at most one of the three), else the world average."""
    given = [name for name, value in (("intensity_g_per_kWh", g_per_kWh), ("energy_mix", mix),
                                      ("country_iso_code", country_iso_code)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"give one source of carbon intensity, not several: {given}")
    if region is not None and country_iso_code is None:
        raise ValueError("`region` needs `country_iso_code` (e.g. country_iso_code='USA', region='california')")
    if g_per_kWh is not None:
        if isinstance(g_per_kWh, bool) or not isinstance(g_per_kWh, (int, float)) or not (
                math.isfinite(g_per_kWh) and g_per_kWh >= 0):
            raise ValueError(f"`intensity_g_per_kWh` must be a finite number >= 0, got {g_per_kWh!r}")
        return CarbonIntensity(float(g_per_kWh), "user", f"{g_per_kWh:g} g/kWh given by the user")
    if mix is not None:
        value = intensity_from_mix(mix)
        shares = ", ".join(f"{k} {v:g}" for k, v in mix.items())
        return CarbonIntensity(value, "mix", f"energy mix ({shares})")
    if country_iso_code is not None:
        return location_intensity(country_iso_code, region)
    return world_average()


def location_intensity(country_iso_code: str, region: str | None = None) -> CarbonIntensity:
    """CodeCarbon's offline intensity for a 3-letter ISO country code and optional region (CodeCarbon's data:
    :class:`~lightning_energy.extras.MissingExtra` when it is not installed)."""
    if not isinstance(country_iso_code, str) or not re.fullmatch(r"[A-Za-z]{3}", country_iso_code):
        raise ValueError(f"`country_iso_code` must be a 3-letter ISO 3166 code such as 'FRA', got {country_iso_code!r}")
    check_installed("codecarbon", "a carbon intensity by country (country_iso_code)")
    iso = country_iso_code.upper()
    data_dir = codecarbon_data_dir()
    if data_dir is None:
        return world_average(f"CodeCarbon's data files not found, so nothing known about {iso}")
    if region is not None:
        found = _region_intensity(data_dir, iso, region)
        if found is not None:
            return found
    mixes = _load_json(data_dir / "global_energy_mix.json")
    if iso not in mixes:
        return world_average(f"CodeCarbon has no data for country {iso!r}")
    entry = mixes[iso]
    value = entry.get("carbon_intensity")
    if value is None:
        value = _country_mix_intensity(entry, _load_json(data_dir / "carbon_intensity_per_source.json"))
    name = entry.get("country_name", iso)
    year = entry.get("year")
    note = f"; region {region!r} unknown to CodeCarbon, country figure used" if region is not None else ""
    source = f"CodeCarbon offline data{f' {year}' if year else ''}"
    return CarbonIntensity(float(value), "country", f"{name} ({iso}) {value:.1f} g/kWh, {source}{note}")


def codecarbon_data_dir() -> Path | None:
    """CodeCarbon's ``data/private_infra`` folder, located without importing codecarbon."""
    spec = importlib.util.find_spec("codecarbon")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "data" / "private_infra"
    return folder if (folder / "global_energy_mix.json").exists() else None


@lru_cache(maxsize=None)
def _load_json(path: Path) -> dict:
    with open(path) as fh:
        return json.load(fh)


def _country_mix_intensity(entry: dict, per_source: dict) -> float:
    """CodeCarbon's computation for a country entry without a published intensity."""
    total = entry["total_TWh"]
    value = 0.0
    for key, twh in entry.items():
        if key.endswith("_TWh") and (source := per_source.get(key[: -len("_TWh")])) is not None:
            value += twh / total * source
    return value


def _region_intensity(data_dir: Path, iso: str, region: str) -> CarbonIntensity | None:
    """A regional figure where CodeCarbon has one, else None (the caller uses the country)."""
    key = " ".join(region.lower().split())
    if iso in _NORDIC_ZONES and region.upper() in _NORDIC_ZONES[iso]:
        entry = _load_json(data_dir / "nordic_emissions.json")["data"].get(region.upper())
        if entry is not None:
            return CarbonIntensity(float(entry["emission_factor"]), "region",
                                   f"{entry.get('description', region)}: {entry['emission_factor']} g/kWh, "
                                   "CodeCarbon offline data")
    if iso == "USA":
        states = _load_json(data_dir / "2023" / "usa_emissions.json")
        entry = states.get(key) or next((v for k, v in states.items() if not k.startswith("_")
                                         and v.get("regionCode", "").lower() == key), None)
        if entry is not None:
            value = entry["emissions"] * LBS_PER_MWH_TO_G_PER_KWH
            return CarbonIntensity(value, "region", f"US {region}: {value:.1f} g/kWh, EPA eGRID via CodeCarbon")
    if iso == "CAN":
        provinces = _load_json(data_dir / "2023" / "canada_energy_mix.json")
        entry = provinces.get(key)
        if entry is not None:
            kg = sum(entry.get(source, 0.0) / entry["total"] * factor
                     for source, factor in _CANADA_SOURCE_KG_PER_KWH.items())
            return CarbonIntensity(kg * G_PER_KG, "region",
                                   f"Canada {region}: {kg * G_PER_KG:.1f} g/kWh from its mix, CodeCarbon offline data")
    if iso == "CHN":
        name = _CHINA_SUFFIX.sub("", key)
        for code, entry in _load_json(data_dir / "2023" / "china_provincial_emissions.json")["data"].items():
            if name in entry.get("names", []) or name == code.lower():
                return CarbonIntensity(float(entry["emission_factor"]), "region",
                                       f"China {entry.get('description', code)}: {entry['emission_factor']} g/kWh, "
                                       "CodeCarbon offline data")
    return None
