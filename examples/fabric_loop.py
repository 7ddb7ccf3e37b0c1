"""Lightning Fabric: EnergyMonitor(fabric) around your own loop; figures go to Fabric's loggers."""

import lightning as L
import torch
from lightning.fabric.loggers import CSVLogger

from lightning_energy import EnergyMonitor

fabric = L.Fabric(accelerator="auto", devices=1, loggers=CSVLogger("runs/fabric"))
fabric.launch()
model = torch.nn.Linear(32, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer = fabric.setup(model, optimizer)
data = fabric.setup_dataloaders(torch.utils.data.DataLoader(torch.randn(512, 33), batch_size=32))

with EnergyMonitor(fabric, verbose=False) as energy:
    for epoch in range(2):
        for batch in data:
            loss = torch.nn.functional.mse_loss(model(batch[:, :32]), batch[:, 32:])
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            energy.step()      # the end of one optimizer step
        energy.epoch()         # the end of an epoch
print(f"{energy.report['total_J']:.1f} J ({energy.report['provenance']}); report in {energy.report_path}")
