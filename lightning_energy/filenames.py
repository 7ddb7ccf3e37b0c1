"""Names of the files a run writes that other layers read back: one low module (no lightning_energy import),
so a reader (the recommender, the offline analysis, the CLI) needs no import of the writer's layer."""

from __future__ import annotations

REPORT_FILE = "energy_report.json"  # EnergyCallback's end-of-fit report, in the run's log dir
