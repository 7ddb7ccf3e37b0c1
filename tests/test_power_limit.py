"""PowerLimitOptimizer against the simulated GPU: Zeus's state machine, selectors, searches, safety, resume.

Time is fake (see power_limit_helpers): every profiled energy and time is the simulator's exact figure,
so the optimum of each selector is known in advance.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import signal
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from conftest import FakeClock, trainer_kwargs
from lightning_energy import EnergyCallback
from lightning_energy.callbacks.power_limit import PowerLimitOptimizer
from lightning_energy.simulate.gpu_sim import (
    COMPUTE_BOUND,
    MEMORY_BOUND,
    SMALL_NET,
    SimulatedGPU,
    SimulatedWorkload,
    StepModel,
)
from lightning_energy.optimize.power_limit.search import (
    AdaptiveSearch,
    ExhaustiveSweep,
    LimitProfile,
    Objective,
    limit_grid,
)
from lightning_energy.optimize.power_limit.profile_file import read_profile
from power_limit_helpers import RecordingLogger, SimModule, ValidatingSimModule, install_fake_time, loader
from zeus_gpus import installed_in_zeus

HERE = Path(__file__).resolve().parent
GRID = [300, 275, 250, 225, 200, 175, 150]
# The simulator's known optimum per selector (compute-bound step of 256 samples, V100 limits; see gpu_sim).
OPTIMUM = {"energy": 150, "time": 300, "zeus_cost": 225, "max_slowdown": 250}


@pytest.fixture
def clock(monkeypatch):
    return install_fake_time(monkeypatch.setattr)


def fit(tmp_path, gpu, callback, batches=40, epochs=1, module=None, extra=(), ckpt_path=None, **overrides):
    """Fit SimModule on ``batches`` batches of 256 with ``callback`` controlling ``gpu``."""
    callback.gpu = gpu
    logger = RecordingLogger()
    kwargs = trainer_kwargs(tmp_path, max_epochs=epochs, logger=[logger], log_every_n_steps=5)
    kwargs.update(overrides)
    trainer = L.Trainer(callbacks=[callback, SimulatedWorkload(gpu=gpu), *extra], **kwargs)
    trainer.fit(module or SimModule(), loader(batches), ckpt_path=ckpt_path)
    return trainer, logger


def optimizer(**kwargs) -> PowerLimitOptimizer:
    defaults = dict(wait_steps=1, warmup_steps=1, profile_steps=3)
    defaults.update(kwargs)
    return PowerLimitOptimizer(**defaults)


# ------------------------------------------------------------------------------------------ the simulator
def test_simulated_gpu_matches_the_v100_study_shape():
    from lightning_energy.analysis.fit import quadratic_fit

    gpu = SimulatedGPU()
    limits = [150, 200, 250, 300]  # the study's limits
    energy = [gpu.step_energy_J(x) for x in limits]
    time_s = [gpu.step_time_s(x) for x in limits]
    edp = [e * t for e, t in zip(energy, time_s)]
    for series in (energy, time_s, edp):
        assert quadratic_fit(limits, series).r2 > 0.99
    assert min(energy) == energy[0]  # the lowest limit the least energy ...
    assert time_s[0] > 1.2 * time_s[-1]  # ... at some cost in time
    memory_bound = SimulatedGPU(step=MEMORY_BOUND)
    assert memory_bound.step_time_s(150) < 1.1 * memory_bound.step_time_s(300)  # barely slower
    small = SimulatedGPU(step=SMALL_NET)  # never reaches the limit: nothing changes
    assert small.step_time_s(150) == small.step_time_s(300)
    assert small.step_energy_J(150) == small.step_energy_J(300)


def test_simulated_gpu_is_a_zeus_gpu_with_nvml_units(clock):
    with contextlib.redirect_stdout(io.StringIO()):
        from zeus.device.gpu.common import GPU, ZeusGPUInvalidArgError, ZeusGPUNoPermissionError

    gpu = SimulatedGPU(clock=clock)
    assert isinstance(gpu, GPU)
    assert gpu.get_power_management_limit_constraints() == (150_000, 300_000)
    assert gpu.get_power_management_limit() == gpu.get_default_power_management_limit() == 300_000
    gpu.set_power_management_limit(200_000)
    before = gpu.get_total_energy_consumption()
    seconds = gpu.run_step(256)
    assert seconds == pytest.approx(gpu.step_time_s(200))
    assert gpu.get_total_energy_consumption() - before == pytest.approx(200 * seconds * 1000, abs=1.0)  # mJ
    with pytest.raises(ZeusGPUInvalidArgError):
        gpu.set_power_management_limit(100_000)
    gpu.reset_power_management_limit()
    assert gpu.power_limit_W == 300
    locked = SimulatedGPU(can_set_limits=False, clock=clock)
    with pytest.raises(ZeusGPUNoPermissionError):
        locked.set_power_management_limit(200_000)
    import torch

    with pytest.raises(torch.OutOfMemoryError):
        gpu.run_step(512)  # 2 GiB + 512 x 48 MiB > 16 GiB


# ------------------------------------------------------------------------------------------ selectors, searches
def profiles_of(gpu, limits, steps=10):
    return {x: LimitProfile(x, gpu.step_energy_J(x) * steps, gpu.step_time_s(x) * steps, steps) for x in limits}


@pytest.mark.parametrize("selector", sorted(OPTIMUM))
def test_zeus_selectors_pick_the_known_optimum(selector):
    gpu = SimulatedGPU()
    assert Objective(selector).select(list(profiles_of(gpu, GRID).values())) == OPTIMUM[selector]


def run_adaptive(search, full: dict) -> tuple[list[int], int]:
    """Drive a search with exact figures; a repeated limit gets another (identical) window merged in."""
    seen, order = {}, []
    while (limit := search.next_limit(seen)) is not None:
        order.append(limit)
        seen[limit] = seen[limit].merged(full[limit]) if limit in seen else full[limit]
    return order, search.choose(seen)


FIRST = {"energy": GRID, "zeus_cost": GRID, "time": [300, 150], "max_slowdown": GRID}  # 7 limits: no calibration
STEPS = {"compute": COMPUTE_BOUND, "memory": MEMORY_BOUND, "small": SMALL_NET}


@pytest.mark.parametrize("workload", sorted(STEPS))
@pytest.mark.parametrize("selector", sorted(OPTIMUM))
def test_adaptive_search_picks_what_the_sweep_picks_on_exact_figures(workload, selector):
    objective = Objective(selector)
    full = profiles_of(SimulatedGPU(step=STEPS[workload]), GRID)
    order, chosen = run_adaptive(AdaptiveSearch(GRID, objective), full)
    assert chosen == objective.select(list(full.values()))  # the sweep's pick
    assert chosen in order  # measured before chosen
    # 7 limits (issue 30): no calibration window (the cap is every limit once); energy and ZeusCost profile every
    # limit in Zeus's order (the equal-budget rule), time and max slowdown start at the maximum and the minimum
    assert order[:len(FIRST[selector])] == FIRST[selector]


def test_adaptive_search_falls_back_to_the_sweep_when_not_unimodal():
    """A bump in energy at constant time: mean power is not monotonic, the bounds do not hold."""
    objective = Objective("energy")
    bumpy = {300: 4.0, 275: 5.0, 250: 6.0, 225: 7.0, 200: 6.0, 175: 3.0, 150: 4.5}  # a peak between two valleys
    full = {x: LimitProfile(x, e, 1.0, 1) for x, e in bumpy.items()}
    search = AdaptiveSearch(GRID, objective)
    order, chosen = run_adaptive(search, full)
    assert search.fell_back({x: full[x] for x in order})
    # the sweep within the sweep's own profiling (issue 30: a hard cap): every limit but the one the calibration
    # window costs, the limits beside the cheapest profiled ones first
    assert len(set(order)) >= len(GRID) - 1 and search.spent_windows <= search.sweep_cost()
    assert chosen == objective.select(list(full.values())) == 175  # the valley the coarse points miss


def test_adaptive_max_slowdown_falls_back_when_time_is_not_monotonic():
    objective = Objective("max_slowdown")
    times = {300: 1.0, 275: 1.01, 250: 1.02, 225: 1.03, 200: 1.04, 175: 1.05, 150: 0.9}  # faster at 150 W than 225 W
    full = {x: LimitProfile(x, 1.0, t, 1) for x, t in times.items()}
    search = AdaptiveSearch(GRID, objective, noise=0.01)  # 7 limits, no calibration: the prior is the noise
    order, _ = run_adaptive(search, full)
    assert search.fell_back({x: full[x] for x in order}) and len(set(order)) >= len(GRID) - 1  # the sweep, capped
    assert search.spent_windows <= search.sweep_cost()


def test_exhaustive_sweep_is_zeus_order_and_grid():
    assert limit_grid(150, 300, 25) == GRID
    assert limit_grid(120, 260, 50) == [260, 210, 160]  # Zeus: range(max, min - 1, -step), 120 W not on it
    sweep = ExhaustiveSweep(GRID)
    assert sweep.next_limit({}) == 300 and sweep.next_limit({300: None, 275: None}) == 250
    assert sweep.next_limit(dict.fromkeys(GRID)) is None


# ------------------------------------------------------------------------------------------ the callback
@pytest.mark.parametrize("search", ["exhaustive", "adaptive"])
@pytest.mark.parametrize("selector", sorted(OPTIMUM))
def test_fit_picks_the_known_optimum_and_restores_the_default(tmp_path, clock, selector, search):
    gpu = SimulatedGPU(clock=clock)
    callback = optimizer(selector=selector, search=search)
    # 60 steps: the adaptive search may settle near-ties (within its 3 % noise prior) past the sweep's 7 windows
    trainer, logger = fit(tmp_path, gpu, callback, batches=60)
    assert callback.chosen_limit_W == OPTIMUM[selector]
    for limit, p in callback.profiles.items():  # exact: fake time, a sample at every step boundary
        assert p.steps == 3 * p.window_count
        assert p.time_per_step_s == pytest.approx(gpu.step_time_s(limit, 256), rel=1e-9)
        assert p.energy_per_step_J == pytest.approx(gpu.step_energy_J(limit, 256), rel=1e-9)
    if search == "exhaustive":
        assert callback.limits_profiled == GRID
    else:
        assert set(callback.limits_profiled) <= set(GRID)
        assert callback.limits_profiled[:len(FIRST[selector])] == FIRST[selector]  # 7 limits: no calibration
    # the chosen limit was in force for the rest of training, then the limit in force before (300 W) came back
    assert limit_at(gpu, 59) == OPTIMUM[selector]
    assert gpu.power_limit_W == 300 and gpu.get_persistence_mode() is False
    assert logger.values("power_limit/chosen_W") == [OPTIMUM[selector]]
    current = logger.values("power_limit/current_W")
    assert current[0] == 300 and OPTIMUM[selector] in current and set(current) <= set(GRID)
    keys = {key for _, metrics in logger.metrics for key in metrics}
    for limit in callback.profiles:
        for name in ("energy_per_step_J", "time_per_step_s", "cost"):
            assert f"power_limit/{limit}W/{name}" in keys
    document = json.loads(callback.profile_file.read_text())
    assert document["chosen_limit_W"] == OPTIMUM[selector]
    assert [row["power_limit"] for row in document["measurements"]] == sorted(callback.profiles, reverse=True)
    assert callback.figure_file.exists() and callback.figure_file.stat().st_size > 1000
    if len(callback.profiles) >= 5:  # a quadratic's R² only with spare points
        assert document["fits"]["energy_per_step_J"]["r2"] > 0.99
    else:
        assert document["fits"]["energy_per_step_J"] is None


def test_profile_figure_is_logged_to_tensorboard(tmp_path, clock):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    gpu = SimulatedGPU(clock=clock)
    callback = optimizer(selector="energy", search="adaptive")
    logger = TensorBoardLogger(tmp_path, name="tb")
    fit(tmp_path, gpu, callback, logger=[logger])
    events = EventAccumulator(logger.log_dir, size_guidance={IMAGES: 0})
    events.Reload()
    assert "power_limit/profile" in events.Tags()[IMAGES]
    (image,) = events.Images("power_limit/profile")
    assert image.encoded_image_string.startswith(b"\x89PNG") and image.width > 500
    assert callback.figure_file.parent == Path(logger.log_dir)  # the PNG beside the event file


def test_our_state_machine_sets_the_same_limits_at_the_same_steps_as_zeus(tmp_path, monkeypatch):
    """Zeus's own GlobalPowerLimitOptimizer drives a simulated GPU; ours must match it step for step."""
    with contextlib.redirect_stdout(io.StringIO()):
        import zeus.monitor.energy as zeus_energy
        from zeus.monitor import ZeusMonitor
        from zeus.optimizer.power_limit import Energy, GlobalPowerLimitOptimizer

    batches_per_epoch, epochs = 10, 3
    quick = StepModel(overhead_s=0.001, per_sample_s=2e-6, contention_s=0.0)  # ~2 ms steps
    # the card's own clock: Zeus reads its energy counter, so the energies it compares are exact, not
    # limit x (real time with sleep overshoot), where 150 W and 175 W differ by only 8 %
    zeus_gpu = SimulatedGPU(gpu_index=7, step=quick, clock=FakeClock())
    monkeypatch.setattr(zeus_energy, "sync_execution_fn", lambda *a, **k: None)  # CUDA sync: no CUDA here
    exit_hooks = []
    monkeypatch.setattr(atexit, "register", lambda fn, *a, **k: exit_hooks.append(fn))
    with installed_in_zeus([zeus_gpu]):
        plo = GlobalPowerLimitOptimizer(ZeusMonitor(gpu_indices=[0], cpu_indices=[]), Energy(),
                                        wait_steps=1, warmup_steps=1, profile_steps=2)
        for step in range(batches_per_epoch * epochs):
            plo.on_step_begin()
            zeus_gpu.run_step(256)
            if (step + 1) % batches_per_epoch == 0:
                plo.on_epoch_end()
        exit_hooks[0]()  # Zeus's exit hook: back to the maximum
    monkeypatch.undo()
    clock = install_fake_time(monkeypatch.setattr)
    ours = SimulatedGPU(clock=clock, step=quick)
    callback = optimizer(selector="energy", warmup_steps=1, profile_steps=2)
    fit(tmp_path, ours, callback, batches=batches_per_epoch, epochs=epochs)
    # Zeus sets the maximum once in its constructor before any step; the rest must be identical
    assert zeus_gpu.limit_events[0] == (0, 300)
    assert ours.limit_events == zeus_gpu.limit_events[1:]
    assert callback.retried_windows == 2 and plo.state.optimal_power_limit == 150_000
    assert callback.chosen_limit_W == 150


def test_interrupted_windows_are_retried_not_mis_measured(tmp_path, clock):
    """Epoch ends and mid-epoch validation runs (each taking fake time) cut windows; they are profiled again."""
    gpu = SimulatedGPU(clock=clock)
    callback = optimizer(selector="energy", warmup_steps=1, profile_steps=2)
    module = ValidatingSimModule(clock=clock, validation_s=5.0)
    val = loader(2)
    logger = RecordingLogger()
    callback.gpu = gpu
    trainer = L.Trainer(callbacks=[callback, SimulatedWorkload(gpu=gpu)], **trainer_kwargs(
        tmp_path, max_epochs=4, logger=[logger], log_every_n_steps=5, val_check_interval=5, num_sanity_val_steps=0))
    trainer.fit(module, loader(10), val)
    assert callback.retried_windows >= 3
    assert sorted(callback.profiles) == sorted(GRID)
    for limit, p in callback.profiles.items():
        assert p.time_per_step_s == pytest.approx(gpu.step_time_s(limit, 256), rel=1e-9)  # no validation inside
    assert callback.chosen_limit_W == 150
    assert logger.values("power_limit/retried_windows") == [callback.retried_windows]


def limit_at(gpu: SimulatedGPU, step: int) -> int:
    """The limit in force while the card ran its ``step``-th simulated step (0-based)."""
    limit = gpu.default_limit_W
    for steps_run, watts in gpu.limit_events:
        if steps_run <= step:
            limit = watts
    return limit


def test_a_step_is_an_optimizer_step_under_gradient_accumulation(tmp_path, clock):
    """Two batches per optimizer step: the windows are the timeline's step marks, so a profiled step holds both
    batches, limits change only at a step's first batch, and the epoch must hold the window's steps."""
    gpu = SimulatedGPU(clock=clock)
    callback = optimizer(selector="energy", search="exhaustive")
    fit(tmp_path, gpu, callback, batches=80, accumulate_grad_batches=2)  # 40 optimizer steps
    assert callback.limits_profiled == GRID and callback.chosen_limit_W == 150
    for limit, p in callback.profiles.items():
        assert p.steps == 3
        assert p.energy_per_step_J == pytest.approx(2 * gpu.step_energy_J(limit, 256), rel=1e-9)
        assert p.time_per_step_s == pytest.approx(2 * gpu.step_time_s(limit, 256), rel=1e-9)
    # 300 W from the start; each next limit at steps 5, 9, ..., 25 (a step's first batch), the choice at 29
    assert [batches for batches, _ in gpu.limit_events] == [2 * step for step in (5, 9, 13, 17, 21, 25)] + [80]
    with pytest.raises(ValueError, match="= 5 training steps of 2 batches in a row, but an epoch has 8 batches"):
        fit(tmp_path / "short", SimulatedGPU(clock=clock), optimizer(), batches=8, accumulate_grad_batches=2)


def test_the_simulated_step_is_in_every_window_wherever_the_workload_stands(tmp_path, monkeypatch):
    """SimulatedWorkload runs the simulated step in ``on_train_batch_end``. A profiling window runs from one
    step's start to a later step's start, so it holds that work wherever SimulatedWorkload stands in
    ``Trainer(callbacks=[...])``. The timeline's own step window (``energy/step_J``) ends in the first suite
    callback's ``on_train_batch_end``: it holds the simulated step only when SimulatedWorkload comes before
    that callback; after it, the work lies between steps (in the epoch's figures, in no step's)."""
    runs = {}
    for place in ("first", "last"):
        clock = install_fake_time(monkeypatch.setattr)
        gpu = SimulatedGPU(clock=clock)
        energy = EnergyCallback(sensors=[gpu.energy_sensor()], verbose=False, write_trace=False)
        callback = optimizer(selector="energy", gpu=gpu, log_figure=False)
        suite = [callback, energy]
        workload = SimulatedWorkload(gpu=gpu)
        logger = RecordingLogger()
        trainer = L.Trainer(callbacks=[workload, *suite] if place == "first" else [*suite, workload], **trainer_kwargs(
            tmp_path / place, max_epochs=1, logger=[logger], log_every_n_steps=1))
        trainer.fit(SimModule(), loader(40))
        runs[place] = (gpu, callback, logger)
        for limit, p in callback.profiles.items():
            assert p.energy_per_step_J == pytest.approx(gpu.step_energy_J(limit, 256), rel=1e-9)
            assert p.time_per_step_s == pytest.approx(gpu.step_time_s(limit, 256), rel=1e-9)
    (gpu, first, first_log), (_, last, last_log) = runs["first"], runs["last"]
    assert first.profiles == last.profiles and first.chosen_limit_W == last.chosen_limit_W == 150
    assert first_log.values("energy/step_J") == pytest.approx(
        [gpu.step_energy_J(limit_at(gpu, step), 256) for step in range(40)], rel=1e-9)
    assert set(last_log.values("energy/step_J")) == set(last_log.values("time/step_s")) == {0.0}
    assert first_log.values("energy/epoch_J") == last_log.values("energy/epoch_J")  # the epoch holds it either way


def test_window_that_cannot_fit_an_epoch_fails_before_training(tmp_path, clock):
    gpu = SimulatedGPU(clock=clock)
    module = SimModule()
    with pytest.raises(ValueError, match="warmup_steps \\+ profile_steps \\+ 1 = 6"):
        fit(tmp_path, gpu, optimizer(warmup_steps=2, profile_steps=3), batches=5, module=module)
    assert module.steps_seen == 0
    assert gpu.power_limit_W == 300


def test_resume_keeps_the_profiles_and_state(tmp_path, clock):
    gpu = SimulatedGPU(clock=clock)
    first = optimizer(selector="zeus_cost")
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    with pytest.warns(UserWarning, match="ended before profiling finished"):
        fit(tmp_path, gpu, first, batches=12, epochs=1, extra=[checkpoints], enable_checkpointing=True)
    assert first.chosen_limit_W is None and 0 < len(first.profiles) < len(GRID)
    profiled_before = set(first.profiles)
    assert gpu.power_limit_W == 300  # restored at the end of the unfinished fit
    # a new process: new card object, new callback, resume from the checkpoint
    gpu2 = SimulatedGPU(clock=clock)
    second = optimizer(selector="zeus_cost")
    fit(tmp_path, gpu2, second, batches=12, epochs=4, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
        extra=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)], enable_checkpointing=True)
    assert set(second.limits_profiled).isdisjoint(profiled_before - {first.limits_profiled[-1]})
    assert sorted(second.profiles) == sorted(GRID)
    assert second.chosen_limit_W == OPTIMUM["zeus_cost"]
    # resuming a finished search applies the choice at once and profiles nothing
    gpu3 = SimulatedGPU(clock=clock)
    third = optimizer(selector="zeus_cost")
    fit(tmp_path, gpu3, third, batches=12, epochs=5, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
        extra=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)], enable_checkpointing=True)
    assert third.limits_profiled == [] and third.chosen_limit_W == OPTIMUM["zeus_cost"]
    assert gpu3.limit_log == [OPTIMUM["zeus_cost"], 300]


def test_profile_file_is_reused_on_the_next_run(tmp_path, clock, caplog, capsys):
    import logging

    caplog.set_level(logging.INFO, logger="lightning_energy")
    path = tmp_path / "profile.json"
    gpu = SimulatedGPU(clock=clock)
    first = optimizer(selector="max_slowdown", profile_path=str(path))
    fit(tmp_path / "a", gpu, first)
    assert path.exists() and first.chosen_limit_W == OPTIMUM["max_slowdown"]
    profiles, document = read_profile(path)
    assert sorted(p.limit_W for p in profiles) == sorted(GRID) and document["gpu_name"] == gpu.name
    gpu2 = SimulatedGPU(clock=clock)
    second = optimizer(selector="energy", profile_path=str(path))  # another selector re-selects from the file
    fit(tmp_path / "b", gpu2, second)
    assert second.limits_profiled == [] and second.chosen_limit_W == OPTIMUM["energy"]
    assert gpu2.limit_log == [OPTIMUM["energy"], 300]
    # the picks are library messages: INFO records of the state machine's module logger, not printed
    ours = [r.getMessage() for r in caplog.records if r.name == "lightning_energy.optimize.power_limit.controller"]
    assert any(f"picks {OPTIMUM['max_slowdown']} W after profiling" in m for m in ours)
    assert any(f"profile loaded from {path}" in m for m in ours)
    assert "PowerLimitOptimizer" not in capsys.readouterr().out


def test_a_zeus_profile_file_is_read_and_a_foreign_range_refused(tmp_path, clock):
    zeus_file = tmp_path / "zeus.json"
    zeus_file.write_text(json.dumps({"measurements": [
        {"power_limit": 300, "energy": 6.8, "time": 0.0226}, {"power_limit": 200, "energy": 5.3, "time": 0.0266}]}))
    gpu = SimulatedGPU(clock=clock)
    callback = optimizer(selector="energy", profile_path=str(zeus_file))
    fit(tmp_path / "a", gpu, callback)
    assert callback.chosen_limit_W == 200 and callback.limits_profiled == []
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"measurements": [{"power_limit": 400, "energy": 1.0, "time": 1.0}]}))
    with pytest.raises(ValueError, match="outside this GPU's range"):
        fit(tmp_path / "b", SimulatedGPU(clock=clock), optimizer(profile_path=str(foreign)))


def test_no_permission_fails_in_setup_naming_the_fixes(tmp_path, clock):
    gpu = SimulatedGPU(clock=clock, can_set_limits=False)
    module = SimModule()
    with pytest.raises(RuntimeError) as info:
        fit(tmp_path, gpu, optimizer(), module=module)
    message = str(info.value)
    for fix in ("zeusd", "ZEUSD_SOCK_PATH", "--cap-add SYS_ADMIN", "dry_run=True"):
        assert fix in message
    assert module.steps_seen == 0 and gpu.limit_log == []


def test_dry_run_reports_without_touching_the_card(tmp_path, clock):
    gpu = SimulatedGPU(clock=clock, can_set_limits=False)
    callback = optimizer(dry_run=True, search="adaptive", selector="zeus_cost")
    fit(tmp_path, gpu, callback, batches=20)
    assert gpu.limit_log == []  # never touched
    report = json.loads(callback.profile_file.read_text())
    assert report == json.loads(json.dumps(callback.dry_run_report))
    assert report["candidate_limits_W"] == GRID
    # 7 limits, ZeusCost: the equal-budget rule (issue 30), every limit once in Zeus's order, no repeat, no
    # calibration (each window: 1 warm-up + 3 profile steps)
    assert report["first_limits_W"] == GRID
    assert report["confirmation_windows"] == 0
    most = 1 + 7 * 4
    assert report["profiling_steps"] == {"min": most, "max": most}
    here = report["measured_at_current_limit"]
    assert here["time_per_step_s"] == pytest.approx(gpu.step_time_s(300, 256), rel=1e-9)
    assert report["expected_profiling_energy_J"]["max"] == pytest.approx(most * gpu.step_energy_J(300, 256), rel=1e-9)
    assert report["can_set_limits"] is False and "can_set_limits=False" in report["permission_problem"]
    assert report["share_of_training"]["max"] == pytest.approx(most / 20)
    assert callback.profile_file.name == "power_limit_dry_run.json" and callback.profile_file.exists()


@pytest.mark.parametrize("exception", [RuntimeError, KeyboardInterrupt])
def test_limit_restored_on_exception_and_ctrl_c(tmp_path, clock, exception):
    gpu = SimulatedGPU(clock=clock)
    module = SimModule(fail_at_step=9, exception=exception)
    expected = SystemExit if exception is KeyboardInterrupt else RuntimeError  # Lightning exits on Ctrl-C
    try:
        with pytest.raises(expected):
            fit(tmp_path, gpu, optimizer(), module=module)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning ignores SIGINT after a Ctrl-C
    assert any(limit < 300 for limit in gpu.limit_log[:-1])  # it was profiling a lower limit ...
    assert gpu.limit_log[-1] == 300 and gpu.power_limit_W == 300  # ... and the default came back


def test_cpu_training_without_a_gpu_is_refused_in_setup(tmp_path):
    module = SimModule()
    trainer = L.Trainer(callbacks=[PowerLimitOptimizer()], **trainer_kwargs(tmp_path))
    with pytest.raises(RuntimeError, match="SimulatedGPU"):
        trainer.fit(module, loader(4))
    assert module.steps_seen == 0


# ------------------------------------------------------------------------------------------ DDP
@pytest.mark.slow
def test_ddp_ranks_apply_one_broadcast_decision(tmp_path, rank_zygote):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    run = rank_zygote.run(HERE / "power_limit_ddp_fit.py", [tmp_path], tmp_path / "ranks", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    expected = ranks[0]["expected"]
    assert expected["merged_choice"] != expected["rank1_alone_choice"]  # a per-rank decision would disagree
    for r in ranks:
        assert r["chosen_W"] == expected["merged_choice"]
        assert r["limit_log"][-1] == 300
    assert ranks[0]["profiles"] == ranks[1]["profiles"]
    for limit, (energy_J, time_s) in ranks[0]["profiles"].items():
        assert energy_J == pytest.approx(expected["energy_J"][limit], rel=1e-9)
        assert time_s == pytest.approx(expected["time_s"][limit], rel=1e-9)


def test_lightning_cli_config_runs_the_optimiser_on_the_simulated_gpu(tmp_path, monkeypatch):
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    from lightning_energy import EnergyCallback

    config = HERE.parent / "configs" / "power_limit_simulated.yaml"
    monkeypatch.setattr("sys.argv", ["lightning-cli"])
    cli = LightningCLI(
        BoringModel, BoringDataModule, run=False, save_config_kwargs={"overwrite": True},
        args=["--config", str(config), "--seed_everything=1", "--trainer.max_epochs=2",
              "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=10",
              f"--trainer.default_root_dir={tmp_path}"],
    )
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, PowerLimitOptimizer)]
    (energy,) = [c for c in cli.trainer.callbacks if isinstance(c, EnergyCallback)]
    gpu = callback.gpu
    assert isinstance(gpu, SimulatedGPU) and gpu.step.overhead_s == 0.001
    cli.trainer.fit(cli.model, cli.datamodule)
    assert callback.chosen_limit_W in GRID and 3 <= len(callback.profiles) <= len(GRID)  # real time: noisy figures
    assert callback.profile_file.exists() and callback.figure_file.exists()
    assert gpu.power_limit_W == 300 and gpu.steps_run > 0
    (sensor,) = energy.report["sensors"]
    assert sensor["name"] == "simgpu0" and sensor["energy_J"] > 0


def test_the_simulated_configs_comment_states_what_the_demo_profiles(tmp_path, monkeypatch, caplog):
    """The figures the config's comment gives (windows, limits, steps against the sweep's, the pick) are what a run
    of it profiles: the card keeps its own clock, so every run profiles the same (issue 30: the comment once
    claimed fewer limits than the sweep's while the demo profiled 11 windows on 7 limits)."""
    import logging
    import re

    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    config = HERE.parent / "configs" / "power_limit_simulated.yaml"
    comment = " ".join(line.strip().lstrip("#").strip() for line in config.read_text().splitlines()
                       if line.strip().startswith("#"))
    stated = re.search(r"it profiles (\d+) windows at (\d+) limits: .*?(\d+) of the sweep's (\d+) steps, and picks "
                       r"(\d+) W", comment)
    assert stated, comment
    caplog.set_level(logging.INFO, logger="lightning_energy")
    monkeypatch.setattr("sys.argv", ["lightning-cli"])
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, save_config_kwargs={"overwrite": True},
                       args=["--config", str(config), "--seed_everything=1", "--trainer.max_epochs=1",
                             "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}"])
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, PowerLimitOptimizer)]
    cli.trainer.fit(cli.model, cli.datamodule)
    s = callback.settings
    windows = callback.limits_profiled
    steps = sum(s.profile_steps + (s.warmup_steps if i == 0 or limit != windows[i - 1] else 0)
                for i, limit in enumerate(windows))
    sweep = len(callback._controller.grid) * (s.warmup_steps + s.profile_steps)
    assert [int(n) for n in stated.groups()] == [len(windows), len(callback.profiles), steps, sweep,
                                                 callback.chosen_limit_W]
    # the log says the same, one line per transition: a warm-up per limit change, a line per window, the pick
    said = [r.getMessage() for r in caplog.records if r.name == "lightning_energy.optimize.power_limit.controller"]
    assert sum(m.startswith("power limit: profiling ") for m in said) == len(windows)
    assert said[-1].startswith(f"power limit: zeus_cost picks {callback.chosen_limit_W} W after profiling "
                               f"{len(callback.profiles)} of 7 limits in {len(windows)} windows")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_real_gpu_read_only_queries_and_a_dry_run_that_changes_nothing(tmp_path):
    """Shared test machines: constraints, current and default limit, energy counter; never a write."""
    from lightning_energy.callbacks.power_limit import default_limit_mW, limit_permission_problem

    with contextlib.redirect_stdout(io.StringIO()):
        from zeus.device import get_gpus

    gpu = get_gpus().gpus[0]
    low, high = gpu.get_power_management_limit_constraints()
    current = gpu.get_power_management_limit()
    assert 0 < low <= current <= high
    assert low <= default_limit_mW(gpu) <= high
    problem = limit_permission_problem(gpu)
    assert problem is None or "SYS_ADMIN" in problem
    if gpu.supports_get_total_energy_consumption():
        first = gpu.get_total_energy_consumption()
        assert gpu.get_total_energy_consumption() >= first > 0
    callback = PowerLimitOptimizer(dry_run=True, wait_steps=1, warmup_steps=2, profile_steps=5, log_figure=False)
    trainer = L.Trainer(callbacks=[callback], **trainer_kwargs(tmp_path, accelerator="gpu", devices=1, max_epochs=1))
    trainer.fit(SimModule(), loader(20))
    assert gpu.get_power_management_limit() == current
    report = callback.dry_run_report
    assert report["current_limit_W"] == current // 1000 and report["limit_constraints_W"] == [low // 1000, high // 1000]
    assert report["measured_at_current_limit"]["time_per_step_s"] > 0


def test_the_callback_tells_the_search_the_limit_just_profiled_and_its_warm_up_share(tmp_path, clock, monkeypatch):
    """The adaptive search gets ``warmup_steps / profile_steps`` and, at every decision, the limit of the window
    that just ended (the one it asked for last), so it can prefer a repeat without warm-up."""
    asked: list[tuple[int | None, int | None]] = []
    original = AdaptiveSearch.next_limit

    def spy(self, profiled, previous=None):
        answer = original(self, profiled, previous)
        asked.append((previous, answer))
        return answer

    monkeypatch.setattr(AdaptiveSearch, "next_limit", spy)
    callback = optimizer(selector="energy", search="adaptive", warmup_steps=2, profile_steps=8)
    fit(tmp_path, SimulatedGPU(clock=clock), callback, batches=200)
    assert callback._strategy.warmup_share == 2 / 8
    decisions = asked[1:]  # the first call, in setup, has profiled nothing
    assert decisions and decisions[0][0] == 300
    assert all(previous == asked[i][1] for i, (previous, _) in enumerate(decisions)), asked
    assert [previous for previous, _ in decisions] == callback.limits_profiled
