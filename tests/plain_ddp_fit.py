"""A 2-process torch.distributed (gloo) loop on CPU measured by the plain EnergyMeter, whose ranks come from the
default process group (no Lightning anywhere); run by test_front_ends_ddp.py. The same work and sensors as
ddp_fit.py and fabric_ddp_fit.py."""

import os
import socket
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from lightning_energy import EnergyMeter, SimulatedSensor  # noqa: E402
from suite_time import tiny_loader  # noqa: E402 - not conftest: that imports Lightning

DEVICE_W, HOST_W = 80.0, 25.0


def rank_main(rank: int, out_dir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rows = [batch for i, batch in enumerate(tiny_loader(n=320)) if i % 2 == rank]  # 10 batches per rank
    with EnergyMeter(log_dir=out_dir, sensors=[SimulatedSensor("device", DEVICE_W),
                                               SimulatedSensor("host", HOST_W, scope="host")], verbose=False) as meter:
        for epoch in range(2):
            for x, y in rows:
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                meter.step()
            with meter.loop("val"), torch.no_grad():
                for x, _ in tiny_loader(n=64):
                    model(x)
            meter.epoch()
    dist.barrier()
    dist.destroy_process_group()
    loaded = sorted(m for m in sys.modules if m == "lightning" or m.startswith(("lightning.", "pytorch_lightning")))
    assert not loaded, f"a plain torch.distributed loop loaded Lightning: {loaded[:3]}"


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.start_processes(rank_main, args=(sys.argv[1], free_port), nprocs=2, start_method="spawn")
