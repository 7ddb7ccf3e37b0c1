"""Every use of a private Zeus or CodeCarbon attribute, one function each (no Lightning here: measure/ is
below it; the Lightning ones are in ``integration/lightning_internals.py``).

Neither package offers a public API for these; each function names the version it was checked against
(Zeus 0.16.0, CodeCarbon 3.3.2). ``tests/test_layout.py`` fails on a private attribute of another package
reached anywhere else. Nothing here imports Zeus or CodeCarbon: callers pass the objects in.
"""

from __future__ import annotations

from typing import Any, Callable


# ---------------------------------------------------------------------- CodeCarbon
def codecarbon_tracker_started(tracker) -> bool:
    """Whether CodeCarbon's tracker really started: its ``start()`` swallows errors, and only its
    ``_start_time`` tells (set by a successful start; checked: CodeCarbon 3.3.2)."""
    return getattr(tracker, "_start_time", None) is not None


def codecarbon_cpu_matcher(tdp_class) -> Callable[..., Any]:
    """CodeCarbon's rule for finding a CPU model in its power table, ``TDP._get_matching_cpu(model, table)``,
    without running ``TDP()``'s hardware detection (checked: CodeCarbon 3.3.2; the method reads no instance
    state)."""
    return tdp_class.__new__(tdp_class)._get_matching_cpu


# ---------------------------------------------------------------------- Zeus
def quiet_zeusd_gpu(gpu) -> None:
    """Stop a ``ZeusdNVIDIAGPU`` warning about missing SYS_ADMIN (the zeusd daemon holds it), as Zeus's own
    ``get_gpus()`` does for its zeusd GPUs: ``_disable_sys_admin_warning`` (checked: Zeus 0.16.0)."""
    gpu._disable_sys_admin_warning = True


async def empty_bso_connection_pool(sessionmanager) -> None:
    """Close the Zeus batch-size server database's pooled connections but keep its engine, so that the
    server's own event loop opens fresh ones (``sessionmanager.close()`` would drop the engine):
    ``sessionmanager._engine.dispose()`` (checked: Zeus 0.16.0)."""
    await sessionmanager._engine.dispose()


def zeus_gpus_slot(zeus_gpu_module) -> Any:
    """The GPUs ``zeus.device.gpu.get_gpus()`` returns once set: the module's ``_gpus`` (checked: Zeus
    0.16.0)."""
    return zeus_gpu_module._gpus


def set_zeus_gpus_slot(zeus_gpu_module, gpus) -> None:
    """Make ``zeus.device.gpu.get_gpus()`` return ``gpus`` (None: detect again; checked: Zeus 0.16.0)."""
    zeus_gpu_module._gpus = gpus


def zeus_profile_list_model(zeus_power_limit_module):
    """The pydantic model Zeus reads its power-limit profile file with (``measurements``: limit, energy,
    time), ``zeus.optimizer.power_limit._PowerLimitMeasurementList`` (checked: Zeus 0.16.0)."""
    return zeus_power_limit_module._PowerLimitMeasurementList