"""A 2-process DDP loop under Lightning Fabric on CPU with simulated sensors, measured by EnergyMonitor; run by
test_front_ends_ddp.py as two ranks forked by rank_zygote.py (by hand, Fabric relaunches it per rank). The same work and sensors as ddp_fit.py."""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.fabric.loggers import CSVLogger  # noqa: E402

from conftest import close_process_group, tiny_loader  # noqa: E402
from lightning_energy import EnergyMonitor, SimulatedSensor  # noqa: E402

DEVICE_W, HOST_W = 80.0, 25.0

if __name__ == "__main__":
    out_dir = sys.argv[1]
    fabric = L.Fabric(strategy="ddp", accelerator="cpu", devices=2, loggers=CSVLogger(out_dir, name="csv"))
    fabric.launch()
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    train = fabric.setup_dataloaders(tiny_loader(n=320))
    val = fabric.setup_dataloaders(tiny_loader(n=64))
    with EnergyMonitor(fabric, sensors=[SimulatedSensor("device", DEVICE_W), SimulatedSensor("host", HOST_W, scope="host")],
                       verbose=False) as energy:
        for epoch in range(2):
            for x, y in train:
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                fabric.backward(loss)
                optimizer.step()
                energy.step(log=energy.timeline.steps_ended % 2 == 1)
            with energy.loop("val"), torch.no_grad():
                for x, y in val:
                    model(x)
            energy.epoch()
    fabric.loggers[0].finalize("success")
    close_process_group()
