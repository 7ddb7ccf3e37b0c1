"""NVML on a real card, read-only: the semantics our sensor and our fakes rely on, measured.

Before this benchmark ``lightning_energy.measure.sensors.nvml`` and ``tests/fakes_nvml.py`` took from NVIDIA's
documentation and Yang et al., "Part-time Power Measurements: nvidia-smi's Lack of Attention" (2023): the
total-energy counter (mJ) advances about every 100 ms and integrates the exact power; on Ampere and newer
the instant power is the mean over the ~25 ms of each 100 ms that the power sensor observes, refreshed with
the counter. This benchmark measures each of those on the card at hand, with read queries only (no clock,
power limit, persistence or MIG change):

1. **Instant field alone**: intervals between its refreshes (changes closer than 5 ms are one refresh: the
   H200 shows a transient value for microseconds at some), idle and under continuous load.
2. **Call cost**: median µs of the NVML calls the sampler makes (counter, instant field, power usage,
   utilisation, SM clock), 2,000 calls each.
3. **Update periods**: the counter and the instant/average power fields polled in one loop for a few
   seconds idle and under continuous load; intervals between changes, counter increments, and when the
   instant field changes relative to the counter.
4. **Which power ``nvmlDeviceGetPowerUsage`` returns** (the instant or the 1-s average field).
5. **The instant field's window**: busy and idle stretches of random lengths (20-150 ms) while only the
   field is polled; fitted: the window [t - lag - length, t - lag] whose mean power best explains the value
   at each refresh t.
6. **Random bursts with the counter** (polled on its own thread, since a counter read holds NVML for
   milliseconds): whether each increment holds its whole period's energy or an observed window's.

On an H200 (driver 580.159, ``benchmarks/results/nvml_semantics*.json``): the counter advances every 100.0 ms
and holds its whole period (R² 0.92 against 0.73 for a 25 ms window); the instant field refreshes every
100.0 ms (p05 99.9, p95 100.2 under load) on its own schedule, 38-82 ms after the counter's updates in four
runs, and holds the mean over the 25 ms ending 11 ms before its refresh (R² 0.98); ``nvmlDeviceGetPowerUsage``
is the 1-s average field; a counter read costs 2.4 ms, the other queries 1-8 µs. A first version of this
benchmark (phase-locked bursts, since replaced) saw the counter's mean power vary 12 % without trend over
the burst phase where the instant field's varied 240 %.

Run on a CUDA machine: ``python benchmarks/nvml_semantics.py [--out PATH] [--refresh-only]`` (default
``benchmarks/results/nvml_semantics.json``); ``--refit PATH`` fits a stored result's traces again.
"""

from __future__ import annotations

import argparse
import bisect
import random
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import machine_info, write_json_atomic  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "nvml_semantics.json"
TRANSIENT_S = 0.005  # changes of the instant field closer than this are one refresh
FIELD_AVERAGE, FIELD_INSTANT = 185, 186  # NVML_FI_DEV_POWER_AVERAGE / _INSTANT (mW)


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"median": statistics.median(ordered), "p05": pick(0.05), "p95": pick(0.95), "n": len(ordered)}


def intervals_ms(times: list[float]) -> list[float]:
    """Intervals (ms) between consecutive times (s)."""
    return [(b - a) * 1000 for a, b in zip(times, times[1:])]


def ms_after_latest(times: list[float], references: list[float]) -> list[float]:
    """For each time (s), how long (ms) after the latest reference time at or before it (none before: left out)."""
    lags = []
    for t in times:
        k = bisect.bisect_right(references, t)
        if k:
            lags.append((t - references[k - 1]) * 1000)
    return lags


class Card:
    """One GPU through pynvml and torch: read-only queries, and a matrix product to keep it busy."""

    def __init__(self, cuda_index: int = 0) -> None:
        import pynvml
        import torch

        from lightning_energy.measure.sensors.nvml import nvml_index_for_cuda_device

        pynvml.nvmlInit()
        self.nvml, self.torch = pynvml, torch
        self.nvml_index = nvml_index_for_cuda_device(pynvml, cuda_index)
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(self.nvml_index)
        torch.cuda.set_device(cuda_index)
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        for _ in range(20):
            self.product()

    def product(self) -> None:
        self.torch.mm(self.a, self.a, out=self.c)
        self.torch.cuda.synchronize()

    def busy_until(self, t_end: float) -> None:
        while time.perf_counter() < t_end:
            self.product()

    def counter_mJ(self) -> int:
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)

    def field_mW(self, field: int) -> float | None:
        value = self.nvml.nvmlDeviceGetFieldValues(self.handle, [field])[0]
        return float(value.value.uiVal) if value.nvmlReturn == 0 else None

    def usage_mW(self) -> int:
        return self.nvml.nvmlDeviceGetPowerUsage(self.handle)

    def describe(self) -> dict:
        nvml = self.nvml
        name = nvml.nvmlDeviceGetName(self.handle)
        return {"gpu": _text(name),
                "driver": _text(nvml.nvmlSystemGetDriverVersion()),
                "architecture": _maybe(lambda: nvml.nvmlDeviceGetArchitecture(self.handle)),
                "power_limit_W": _maybe(lambda: nvml.nvmlDeviceGetPowerManagementLimit(self.handle) / 1000),
                "limit_constraints_W": _maybe(lambda: [v / 1000 for v in
                                                       nvml.nvmlDeviceGetPowerManagementLimitConstraints(self.handle)]),
                "torch": self.torch.__version__}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _maybe(query):
    try:
        return query()
    except Exception as err:  # noqa: BLE001 - a query the card lacks is recorded, not fatal
        return f"unavailable: {type(err).__name__}"


def call_costs(card: Card, calls: int = 2000) -> dict[str, float]:
    """Median µs per call of each query the sampler makes."""
    nvml, handle = card.nvml, card.handle
    queries = {
        "nvmlDeviceGetTotalEnergyConsumption": card.counter_mJ,
        "nvmlDeviceGetFieldValues(POWER_INSTANT)": lambda: card.field_mW(FIELD_INSTANT),
        "nvmlDeviceGetPowerUsage": card.usage_mW,
        "nvmlDeviceGetUtilizationRates": lambda: nvml.nvmlDeviceGetUtilizationRates(handle),
        "nvmlDeviceGetClockInfo(SM)": lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
    }
    costs = {}
    for name, query in queries.items():
        samples = []
        for _ in range(calls):
            start = time.perf_counter()
            query()
            samples.append((time.perf_counter() - start) * 1e6)
        costs[name] = statistics.median(samples)
    return costs


def poll_changes(card: Card, seconds: float, busy: bool) -> dict:
    """Times at which the counter, the instant field and the average field change (tight loop)."""
    changes = {"counter": [], "instant": [], "average": []}
    increments = []
    last = {"counter": card.counter_mJ(), "instant": card.field_mW(FIELD_INSTANT),
            "average": card.field_mW(FIELD_AVERAGE)}
    t_end = time.perf_counter() + seconds
    polls = 0
    while (now := time.perf_counter()) < t_end:
        if busy:
            card.torch.mm(card.a, card.a, out=card.c)  # queued; the loop keeps polling while it runs
            if polls % 4 == 0:
                card.torch.cuda.synchronize()
        current = {"counter": card.counter_mJ(), "instant": card.field_mW(FIELD_INSTANT),
                   "average": card.field_mW(FIELD_AVERAGE)}
        polls += 1
        for key, value in current.items():
            if value != last[key]:
                changes[key].append(now)
                if key == "counter":
                    increments.append(value - last[key])
                last[key] = value
    card.torch.cuda.synchronize()
    result = {"polls": polls, "poll_interval_us": seconds / max(polls, 1) * 1e6}
    for key, times in changes.items():
        intervals = intervals_ms(times)
        result[f"{key}_interval_ms"] = quantiles(intervals) if intervals else None
    if increments:
        result["counter_increment_mJ"] = quantiles([float(i) for i in increments])
    lags = ms_after_latest(changes["instant"], changes["counter"])  # instant-field change after a counter change
    if lags:
        result["instant_change_after_counter_change_ms"] = quantiles(lags)
    return result


def refresh_intervals(card: Card, seconds: float, busy: bool) -> dict:
    """Intervals (ms) between changes of the instant field alone, polled with nothing else (a counter read
    holds NVML for milliseconds), idle or under continuous load."""
    times, last = [], card.field_mW(FIELD_INSTANT)
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        if busy:
            card.product()
        value = card.field_mW(FIELD_INSTANT)
        if value != last:
            times.append(time.perf_counter())
            last = value
    intervals = intervals_ms([t for t, _ in refreshes([(t, 0.0) for t in times])])
    return {"intervals_ms": intervals, **(quantiles(intervals) if intervals else {})}


def usage_vs_fields(card: Card, busy: bool, samples: int = 30) -> dict:
    """Which field ``nvmlDeviceGetPowerUsage`` matches, idle or busy (read together, 20 ms apart)."""
    rows = []
    for _ in range(samples):
        t_end = time.perf_counter() + 0.02
        if busy:
            card.busy_until(t_end)
        else:
            time.sleep(0.02)
        rows.append((card.usage_mW(), card.field_mW(FIELD_INSTANT), card.field_mW(FIELD_AVERAGE)))
    same_instant = sum(u == i for u, i, _ in rows)
    same_average = sum(u == a for u, _, a in rows)
    return {"samples": samples, "usage_equals_instant": same_instant, "usage_equals_average": same_average,
            "median_W": {"usage": statistics.median(r[0] for r in rows) / 1000,
                         "instant": statistics.median(r[1] or 0 for r in rows) / 1000,
                         "average": statistics.median(r[2] or 0 for r in rows) / 1000}}


def wait_for_update(card: Card, last: int) -> tuple[float, int]:
    while (value := card.counter_mJ()) == last:
        pass
    return time.perf_counter(), value


def random_bursts(card: Card, seconds: float, seed: int = 0, with_counter: bool = True) -> dict:
    """Busy and idle stretches of random lengths (20-150 ms each); every change of the counter (polled on its
    own thread: a counter read blocks for milliseconds) and of the instant field, with perf_counter times."""
    rng = random.Random(seed)
    counter_events: list[tuple[float, int]] = []
    stop = threading.Event()

    def poll_counter() -> None:
        last = card.counter_mJ()
        while not stop.is_set():
            value = card.counter_mJ()
            if value != last:
                counter_events.append((time.perf_counter(), value))
                last = value

    poller = threading.Thread(target=poll_counter, daemon=True)
    if with_counter:  # its reads hold NVML for milliseconds: without it the field's changes are timed exactly
        poller.start()
    instant_events: list[tuple[float, float]] = []
    busy: list[tuple[float, float]] = []
    last_instant = card.field_mW(FIELD_INSTANT)
    t_end = time.perf_counter() + seconds
    busy_now, switch_at = False, time.perf_counter() + rng.uniform(0.02, 0.15)
    while (now := time.perf_counter()) < t_end:
        if now >= switch_at:
            if busy_now:
                busy[-1] = (busy[-1][0], time.perf_counter())  # products run synchronously: the GPU is idle now
            else:
                busy.append((now, now))
            busy_now, switch_at = not busy_now, now + rng.uniform(0.02, 0.15)
        if busy_now:
            card.product()  # ~0.2 ms on an H100/H200; keeps the GPU busy while the loop polls
        value = card.field_mW(FIELD_INSTANT)
        if value != last_instant:
            instant_events.append((time.perf_counter(), value))
            last_instant = value
    if busy_now:
        busy[-1] = (busy[-1][0], time.perf_counter())
    stop.set()
    if with_counter:
        poller.join()
    return {"seconds": seconds, "seed": seed, "busy": busy, "counter": counter_events, "instant": instant_events}


def _overlap(start: float, end: float, busy: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, e) - max(start, s)) for s, e in busy)


def _least_squares(features: list[float], targets: list[float]) -> tuple[float, float, float]:
    """target ≈ a + b·feature: (a, b, R²)."""
    n = len(features)
    mx, my = sum(features) / n, sum(targets) / n
    sxx = sum((x - mx) ** 2 for x in features)
    if sxx == 0:
        return my, 0.0, 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(features, targets)) / sxx
    a = my - b * mx
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(features, targets))
    ss_tot = sum((y - my) ** 2 for y in targets) or 1.0
    return a, b, 1 - ss_res / ss_tot


def refreshes(events: list[tuple[float, float]], within_s: float = TRANSIENT_S) -> list[tuple[float, float]]:
    """The field's refreshes from its changes: a refresh can show a transient value for microseconds (seen on
    the H200: two changes a few µs apart at some refreshes), so changes closer than ``within_s`` are one
    refresh, with the later value."""
    merged: list[tuple[float, float]] = []
    for t, value in events:
        if merged and t - merged[-1][0] < within_s:
            merged[-1] = (t, value)
        else:
            merged.append((t, value))
    return merged


def fit_instant_window(trace: dict) -> dict:
    """The window the instant field averages: value at a refresh time t ≈ P_idle + ΔP · busy share of
    [t - lag - length, t - lag]; the (lag, length) with the best R² (lag on a 1 ms grid)."""
    busy, events = trace["busy"], refreshes(trace["instant"])[1:]
    t0 = trace["busy"][0][0] if trace["busy"] else 0.0
    events = [(t, v) for t, v in events if t - 0.3 > t0]  # the first stretch has no history
    best = None
    for length_ms in (5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 60, 75, 100):
        for lag_ms in range(0, 101):
            lag, length = lag_ms / 1000, length_ms / 1000
            shares = [_overlap(t - lag - length, t - lag, busy) / length for t, _ in events]
            idle, delta, r2 = _least_squares(shares, [v / 1000 for _, v in events])
            if best is None or r2 > best["r2"]:
                best = {"lag_ms": lag_ms, "length_ms": length_ms, "r2": r2, "idle_W": idle, "busy_W": idle + delta}
    return best | {"n": len(events)}


def fit_counter(trace: dict) -> dict:
    """Whether each counter increment holds the whole period's energy (ΔE ≈ P_idle·Δt + ΔP·busy time in
    [previous update - lag, update - lag]) or only an observed window of it (ΔE ≈ Δt·(P_idle + ΔP·busy
    share of the last ``length`` before the update - lag)); best lag on a 1 ms grid for each model."""
    busy, events = trace["busy"], trace["counter"]
    t0 = trace["busy"][0][0] if trace["busy"] else 0.0
    pairs = [(a, b) for a, b in zip(events, events[1:]) if a[0] - 0.3 > t0]
    result = {}
    for model, length_ms in (("whole period", None), ("25 ms window", 25), ("50 ms window", 50)):
        best = None
        for lag_ms in range(0, 101):
            lag = lag_ms / 1000
            xs, ys = [], []
            for (ta, ea), (tb, eb) in pairs:
                dt = tb - ta
                if length_ms is None:
                    share = _overlap(ta - lag, tb - lag, busy) / dt
                else:
                    share = _overlap(tb - lag - length_ms / 1000, tb - lag, busy) / (length_ms / 1000)
                xs.append(share)
                ys.append((eb - ea) / 1000 / dt)  # mean power over the period, W
            idle, delta, r2 = _least_squares(xs, ys)
            if best is None or r2 > best["r2"]:
                best = {"lag_ms": lag_ms, "r2": r2, "idle_W": idle, "busy_W": idle + delta}
        result[model] = best
    counter_times = [t for t, _ in events]
    refresh_times = [t for t, _ in refreshes(trace["instant"])]
    phases = ms_after_latest(refresh_times, counter_times)
    result["instant_change_after_counter_update_ms"] = quantiles(phases) if phases else None
    intervals = intervals_ms(counter_times)
    result["counter_interval_ms"] = quantiles(intervals) if intervals else None
    intervals = intervals_ms(refresh_times)
    result["instant_interval_ms"] = quantiles(intervals) if intervals else None
    return result


def continuous_W(card: Card, seconds: float, busy: bool) -> float:
    _, e0 = wait_for_update(card, card.counter_mJ())
    t0 = time.perf_counter()
    t_end = t0 + seconds
    if busy:
        card.busy_until(t_end)
    else:
        time.sleep(seconds)
    t1, e1 = wait_for_update(card, card.counter_mJ())
    return (e1 - e0) / 1000 / (t1 - t0)


def refit(path: Path) -> None:
    """Recompute the fits of a stored result from its raw traces (the fits changed, the data did not)."""
    import json

    result = json.loads(path.read_text())
    if "instant_window_alone" in result:
        trace = result["instant_window_alone"]["trace"]
        result["instant_window_alone"] = fit_instant_window(trace) | {"trace": trace}
        fitted = {k: v for k, v in result["instant_window_alone"].items() if k != "trace"}
        print(f"{path.name}: instant window alone {fitted}")
    if "random_bursts" in result:
        trace = result["random_bursts"]["trace"]
        result["random_bursts"] = {"instant_window": fit_instant_window(trace), "counter": fit_counter(trace),
                                   "trace": trace}
        print(f"{path.name}: random bursts {result['random_bursts']['instant_window']}, "
              f"{ {k: v for k, v in result['random_bursts']['counter'].items()} }")
    result["refit"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    write_json_atomic(path, result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--refresh-only", action="store_true",
                        help="only the instant field: its refresh intervals and window (no counter reads)")
    parser.add_argument("--seconds", type=float, default=3.0, help="polling time per state (default 3)")
    parser.add_argument("--refit", type=Path, help="fit the traces of a stored result again and rewrite it")
    args = parser.parse_args()
    if args.refit is not None:
        if not args.refit.is_file():
            parser.exit(2, f"nvml_semantics: --refit {args.refit}: no such file\n")
        refit(args.refit)
        return
    import torch

    if not torch.cuda.is_available():
        print("nvml_semantics: needs a CUDA GPU with NVML; none here, nothing measured")
        return
    started = time.perf_counter()
    card = Card()
    result = {"benchmark": "nvml_semantics", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "card": card.describe()}
    print(f"nvml_semantics on {result['card']}", flush=True)
    result["instant_refresh"] = {state: refresh_intervals(card, args.seconds, busy=state == "busy")
                                 for state in ("idle", "busy")}
    for state, row in result["instant_refresh"].items():
        print(f"  instant field alone, {state}: changes every {row.get('median', float('nan')):.1f} ms (p05 "
              f"{row.get('p05', float('nan')):.1f}, p95 {row.get('p95', float('nan')):.1f}, n {row.get('n', 0)})")
    trace = random_bursts(card, args.seconds * 3, seed=1, with_counter=False)
    window = fit_instant_window(trace)
    result["instant_window_alone"] = window | {"trace": trace}
    print(f"  instant field alone = mean power over [t - {window['lag_ms'] + window['length_ms']} ms, "
          f"t - {window['lag_ms']} ms] at its refresh t (R² {window['r2']:.3f}, n {window['n']}; idle "
          f"{window['idle_W']:.0f} W, busy {window['busy_W']:.0f} W)")
    if args.refresh_only:
        write_json_atomic(args.out, result)
        return
    result["call_cost_us"] = call_costs(card)
    for name, us in result["call_cost_us"].items():
        print(f"  {name:42s} {us:8.1f} µs / call (median of 2000)", flush=True)
    result["idle_W"] = continuous_W(card, 1.0, busy=False)
    result["busy_W"] = continuous_W(card, 1.0, busy=True)
    print(f"  counter mean power: idle {result['idle_W']:.1f} W, "
          f"continuous bf16 4096^3 products {result['busy_W']:.1f} W")
    result["polled"] = {"idle": poll_changes(card, args.seconds, busy=False),
                        "busy": poll_changes(card, args.seconds, busy=True)}
    for state, polled in result["polled"].items():
        print(f"  {state}: poll every {polled['poll_interval_us']:.0f} µs", flush=True)
        for key in ("counter", "instant", "average"):
            q = polled.get(f"{key}_interval_ms")
            text = "never changed" if q is None else (f"median {q['median']:.1f} ms (p05 {q['p05']:.1f}, "
                                                       f"p95 {q['p95']:.1f}, n {q['n']})")
            print(f"    {key:8s} changes every {text}")
        if "instant_change_after_counter_change_ms" in polled:
            q = polled["instant_change_after_counter_change_ms"]
            print(f"    instant field changes {q['median']:.1f} ms after a counter change (median; p05 {q['p05']:.1f},"
                  f" p95 {q['p95']:.1f})")
    result["power_usage_is"] = {"idle": usage_vs_fields(card, busy=False), "busy": usage_vs_fields(card, busy=True)}
    for state, row in result["power_usage_is"].items():
        print(f"  nvmlDeviceGetPowerUsage {state}: = instant {row['usage_equals_instant']}/{row['samples']}, "
              f"= average {row['usage_equals_average']}/{row['samples']}; medians {row['median_W']}")
    trace = random_bursts(card, args.seconds * 3)
    result["random_bursts"] = {"instant_window": fit_instant_window(trace), "counter": fit_counter(trace),
                               "trace": trace}
    window, counter = result["random_bursts"]["instant_window"], result["random_bursts"]["counter"]
    print(f"  random bursts ({trace['seconds']:.0f} s, {len(trace['busy'])} bursts of 20-150 ms):")
    print(f"    instant field = mean power over [t - {window['lag_ms'] + window['length_ms']} ms, "
          f"t - {window['lag_ms']} ms]"
          f" at its change time t (best fit, R² {window['r2']:.3f}, n {window['n']}; idle {window['idle_W']:.0f} W,"
          f" busy {window['busy_W']:.0f} W)")
    for model in ("whole period", "25 ms window", "50 ms window"):
        row = counter[model]
        print(f"    counter increment = {model:13s} energy: R² {row['r2']:.3f} (lag {row['lag_ms']} ms)")
    for key in ("counter_interval_ms", "instant_interval_ms", "instant_change_after_counter_update_ms"):
        q = counter[key]
        if q:
            print(f"    {key:40s} median {q['median']:6.1f} (p05 {q['p05']:.1f}, p95 {q['p95']:.1f}, n {q['n']})")
    result["wall_s"] = time.perf_counter() - started
    write_json_atomic(args.out, result)
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
