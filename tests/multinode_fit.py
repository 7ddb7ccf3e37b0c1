"""One rank of a simulated 2 nodes x 2 ranks DDP fit on CPU (gloo); run 4 times by test_multinode.py.

The test is the launcher: it starts one process per global rank with the environment an external launcher
(a scheduler, ``torchrun``) would set, so Lightning runs each process as the rank it is told and spawns none:

    MASTER_ADDR=127.0.0.1  MASTER_PORT=<free port>   rendezvous of the gloo process group
    NODE_RANK=0|1  LOCAL_RANK=0|1                     read by LightningEnvironment; LOCAL_RANK's presence
                                                      is what makes it "creates_processes_externally"
    WORLD_SIZE=4  RANK=2*NODE_RANK+LOCAL_RANK         informative only: Lightning derives the global rank
                                                      and world size from num_nodes, devices and the above

Both "nodes" share this host, so "one host sensor per node" rests on ``trainer.local_rank == 0``; each node is
named apart in the report (``simnode<NODE_RANK>``, as a cluster's nodes are), so its node entry (a node-scope
sensor, a BMC's stand-in) has one host per node; the timeline still sees one host (one clock: no wall-clock
conversion between the nodes, whose offsets would differ by the microseconds between two clock reads).
Usage: ``multinode_fit.py OUT_DIR``.
"""

import os
import sys
import types
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.fabric.plugins.environments import LightningEnvironment  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from conftest import TinyRegressor, tiny_loader  # noqa: E402
from lightning_energy import EnergyCallback, SimulatedSensor  # noqa: E402
from lightning_energy.core import recorder  # noqa: E402

DEVICE_W, HOST_W, NODE_W = 80.0, 25.0, 400.0  # per rank, per node, per node (the whole node: a BMC)
NUM_NODES, DEVICES = 2, 2
EPOCHS = 3
ROWS = 256  # 4 ranks x 4 steps of 16 rows per epoch

if __name__ == "__main__":
    out_dir = sys.argv[1]
    # read now: LightningEnvironment.teardown removes WORLD_SIZE from the environment at the end of the fit
    launched = {k: int(os.environ[k]) for k in ("NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    torch.set_num_threads(1)
    recorder.socket = types.SimpleNamespace(gethostname=lambda: f"simnode{launched['NODE_RANK']}")  # as named apart
    callback = EnergyCallback(
        sensors=[SimulatedSensor("device", DEVICE_W, scope="device"), SimulatedSensor("host", HOST_W, scope="host"),
                 SimulatedSensor("bmc", NODE_W, scope="node")],
        verbose=False,
        log_power_figure=False,
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=DEVICES, num_nodes=NUM_NODES, max_epochs=EPOCHS, default_root_dir=out_dir,
        # the same as strategy="ddp" on CPU (gloo), with a short collective timeout so a dead peer fails the run
        # well within the test's own timeout, and the environment given rather than detected, so that a
        # scheduler's variables around the test (SLURM_*, KUBERNETES_PORT...) cannot take over
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)),
        plugins=[LightningEnvironment()],
        callbacks=[callback], logger=CSVLogger(out_dir, name="csv"), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=2, num_sanity_val_steps=0,
    )
    trainer.fit(TinyRegressor(), tiny_loader(n=ROWS))
    # the launch is what we meant it to be: no process spawned, ranks as the launcher set them
    env = trainer.strategy.cluster_environment
    assert type(env) is LightningEnvironment and env.creates_processes_externally, env
    ranks = {"NODE_RANK": trainer.node_rank, "LOCAL_RANK": trainer.local_rank, "RANK": trainer.global_rank,
             "WORLD_SIZE": trainer.world_size}
    assert ranks == launched and launched["WORLD_SIZE"] == NUM_NODES * DEVICES, (ranks, launched)
    # Lightning leaves a CPU (gloo) process group up; torn down by the interpreter's exit, its threads now and
    # then abort the process ("terminate called without an active exception", exit code -6) after a good fit
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
