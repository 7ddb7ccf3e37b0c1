"""Deterministic synthetic CMS-jet-like table: the default data when no input file is given.

24 columns shaped like the reconstructed-jet columns of Baler's CMS open-data set: 15 float32 kinematic and
energy columns (GeV, radians, cm, dimensionless area) and 9 int32 constituent multiplicities. Transverse
momenta follow a power law (heavy tail), energies follow from pt and eta, energy fractions from a
Dirichlet draw, multiplicities from Poisson draws whose means grow with the jet energy. The same
``(n_rows, seed)`` always gives the same table.
"""

from __future__ import annotations

import numpy as np

from .errors import BalerInputError
from .table import Table

#: Lower pt cut of the jets (GeV) and power-law index of the pt spectrum dN/dpt ∝ pt^-(PT_INDEX+1).
PT_MIN_GEV = 20.0
PT_INDEX = 3.0
#: |eta| acceptance of the detector, and the |eta| beyond which jets land in the forward (HF) calorimeter.
ETA_MAX = 4.7
ETA_HF = 3.0
#: Area of an anti-kt R=0.5 jet, pi·0.5² (dimensionless, in eta-phi units).
AK5_AREA = np.pi * 0.25
#: Smallest energy deposit of one particle species recorded in a jet (GeV); smaller ones read as 0.
MIN_DEPOSIT_GEV = 0.01

FLOAT_COLUMNS = [
    "pt", "eta", "phi", "mass", "energy", "jet_area", "pileup_energy", "vertex_z",
    "charged_hadron_energy", "neutral_hadron_energy", "photon_energy", "electron_energy", "muon_energy",
    "hf_hadron_energy", "hf_em_energy",
]  # fmt: skip
INT_COLUMNS = [
    "charged_hadron_multiplicity", "neutral_hadron_multiplicity", "photon_multiplicity",
    "electron_multiplicity", "muon_multiplicity", "hf_hadron_multiplicity", "hf_em_multiplicity",
    "charged_multiplicity", "neutral_multiplicity",
]  # fmt: skip
COLUMNS = FLOAT_COLUMNS + INT_COLUMNS


def synthetic_cms_jets(n_rows: int = 100_000, seed: int = 0) -> Table:
    """Generate ``n_rows`` jets × 24 columns (15 float32, 9 int32), deterministic by ``seed``."""
    if int(n_rows) < 1:
        raise BalerInputError(f"synthetic_rows must be >= 1, got {n_rows}")
    n = int(n_rows)
    rng = np.random.default_rng(seed)
    pt = PT_MIN_GEV * (1.0 - rng.random(n)) ** (-1.0 / PT_INDEX)
    eta = np.clip(rng.normal(0.0, 1.6, n), -ETA_MAX, ETA_MAX)
    phi = rng.uniform(-np.pi, np.pi, n)
    mass = pt * rng.lognormal(np.log(0.12), 0.35, n)
    energy = np.sqrt((pt * np.cosh(eta)) ** 2 + mass**2)
    area = np.clip(rng.normal(AK5_AREA, 0.08, n), 0.0, None)
    pileup = rng.gamma(2.0, 1.5, n)
    vertex_z = rng.normal(0.0, 5.0, n)

    forward = np.abs(eta) > ETA_HF
    # central: charged had, neutral had, photon, electron, muon; forward: HF hadronic, HF EM
    frac_central = rng.dirichlet([6.5, 1.5, 2.5, 0.15, 0.1], n)
    frac_forward = rng.dirichlet([3.0, 2.0], n)
    fractions = np.zeros((n, 7))
    fractions[~forward, :5] = frac_central[~forward]
    fractions[forward, 5:] = frac_forward[forward]
    energies = fractions * energy[:, None]
    energies[energies < MIN_DEPOSIT_GEV] = 0.0  # below threshold the detector reads zero

    log_e = np.log1p(energy)
    scale = np.array([3.0, 1.2, 2.5, 0.3, 0.2, 2.0, 1.8])
    mult = rng.poisson(scale[None, :] * log_e[:, None] * (energies > 0))
    charged = mult[:, 0] + mult[:, 3] + mult[:, 4]
    neutral = mult[:, 1] + mult[:, 2] + mult[:, 5] + mult[:, 6]

    floats = np.column_stack([pt, eta, phi, mass, energy, area, pileup, vertex_z, energies]).astype(np.float32)
    ints = np.column_stack([mult, charged, neutral]).astype(np.int32)
    data = np.empty((n, len(COLUMNS)), dtype=np.float64)
    data[:, : len(FLOAT_COLUMNS)] = floats
    data[:, len(FLOAT_COLUMNS) :] = ints
    dtypes = ["float32"] * len(FLOAT_COLUMNS) + ["int32"] * len(INT_COLUMNS)
    return Table(data, names=list(COLUMNS), dtypes=dtypes, source=f"synthetic CMS jets (rows={n}, seed={seed})")
