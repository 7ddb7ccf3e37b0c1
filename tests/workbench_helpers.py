"""Hand-made run dirs with known power, in the file format EnergyCallback writes."""

from __future__ import annotations

import csv
import json
from pathlib import Path


def write_run(folder: Path, watts: dict[str, float], duration_s: float, dt_s: float = 0.1,
              epochs: list[tuple] = (), attributes: dict | None = None, counter_every: int = 1) -> Path:
    """A run dir whose sensors draw constant ``watts`` from t=0 to ``duration_s``.

    ``epochs``: (start_s, end_s) or (start_s, end_s, validation_start_s, validation_end_s) per epoch.
    ``counter_every``: the energy column is filled only every n-th row (like a slow counter), blank between.
    """
    folder.mkdir(parents=True, exist_ok=True)
    names = list(watts)
    rows = round(duration_s / dt_s) + 1
    with open(folder / "energy_trace.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["time_s", "unix_time_s"] + [f"{n}:{f}" for n in names for f in ("energy_J", "power_W")])
        for i in range(rows):
            t = i * dt_s
            row = [f"{t:.6f}", f"{1.7e9 + t:.6f}"]
            for n in names:
                filled = i % counter_every == 0 or i == rows - 1
                row += [f"{watts[n] * t:.10g}" if filled else "", f"{watts[n]:.10g}"]
            writer.writerow(row)
    events = [(0.0, "fit_start", "")]
    for epoch, bounds in enumerate(epochs):
        events.append((bounds[0], "epoch_start", epoch))
        if len(bounds) == 4:
            events += [(bounds[2], "validation_start", epoch), (bounds[3], "validation_end", epoch)]
        events.append((bounds[1], "epoch_end", epoch))
    events.append((duration_s, "fit_end", ""))
    with open(folder / "energy_events.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["time_s", "unix_time_s", "event", "epoch", "step"])
        for t, name, epoch in events:
            writer.writerow([f"{t:.6f}", f"{1.7e9 + t:.6f}", name, epoch, ""])
    if attributes is not None:
        (folder / "run_attributes.json").write_text(json.dumps(attributes))
    return folder
