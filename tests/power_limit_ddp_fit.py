"""Two CPU ranks, each with its own simulated GPU; run by test_power_limit.py as two ranks
forked by rank_zygote.py (by hand, Lightning relaunches it per rank).

Rank 0's card runs a compute-bound step, rank 1's a memory-bound one, so each alone would choose a
different limit. Writes ``rank<N>.json`` with what the rank measured and applied, and the limit the merged
profile (energy summed over ranks, time of the slowest) must give.
"""

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L  # noqa: E402

from lightning_energy.callbacks.power_limit import PowerLimitOptimizer  # noqa: E402
from lightning_energy.simulate.gpu_sim import COMPUTE_BOUND, MEMORY_BOUND, SimulatedGPU, SimulatedWorkload  # noqa: E402
from lightning_energy.optimize.power_limit.search import (  # noqa: E402
    AdaptiveSearch,
    LimitProfile,
    Objective,
    limit_grid,
)
from power_limit_helpers import SimModule, install_fake_time, loader  # noqa: E402

PROFILE_STEPS = 3


def expected_choices() -> dict:
    """What one decision over both ranks' exact figures gives, and what rank 1 alone would pick."""
    cards = [SimulatedGPU(gpu_index=9, step=COMPUTE_BOUND), SimulatedGPU(gpu_index=9, step=MEMORY_BOUND)]
    grid = limit_grid(150, 300, 25)
    merged = {x: LimitProfile(x, PROFILE_STEPS * sum(c.step_energy_J(x) for c in cards),
                              PROFILE_STEPS * max(c.step_time_s(x) for c in cards), PROFILE_STEPS) for x in grid}
    objective = Objective("zeus_cost", world_size=2)
    search, seen = AdaptiveSearch(grid, objective), {}
    while (limit := search.next_limit(seen)) is not None:
        seen[limit] = seen[limit].merged(merged[limit]) if limit in seen else merged[limit]
    alone = [LimitProfile(x, cards[1].step_energy_J(x), cards[1].step_time_s(x), 1) for x in grid]
    return {
        "merged_choice": search.choose(seen),
        "rank1_alone_choice": Objective("zeus_cost").select(alone),
        "energy_J": {str(x): p.energy_per_step_J for x, p in seen.items()},
        "time_s": {str(x): p.time_per_step_s for x, p in seen.items()},
    }


from conftest import close_process_group  # noqa: E402

if __name__ == "__main__":
    out_dir = sys.argv[1]
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    clock = install_fake_time(setattr)
    gpu = SimulatedGPU(clock=clock, step=COMPUTE_BOUND if rank == 0 else MEMORY_BOUND)
    callback = PowerLimitOptimizer(selector="zeus_cost", search="adaptive", wait_steps=1, warmup_steps=1,
                                   profile_steps=PROFILE_STEPS, gpu=gpu, log_figure=False)
    trainer = L.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_epochs=1, default_root_dir=out_dir,
        callbacks=[callback, SimulatedWorkload(gpu=gpu)], enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, logger=False,
    )
    trainer.fit(SimModule(), loader(120))  # 60 steps per rank: room for settling repeats
    close_process_group()
    result = {
        "rank": trainer.global_rank,
        "chosen_W": callback.chosen_limit_W,
        "limit_log": gpu.limit_log,
        "profiles": {str(x): [p.energy_per_step_J, p.time_per_step_s] for x, p in callback.profiles.items()},
        "expected": expected_choices(),
    }
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as fh:
        json.dump(result, fh)
