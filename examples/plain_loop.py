"""Plain PyTorch: EnergyMeter around a loop (TensorBoard through a SummaryWriter), and a window for any block."""

import torch
from torch.utils.tensorboard import SummaryWriter

from lightning_energy import EnergyMeter

model = torch.nn.Linear(32, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.DataLoader(torch.randn(512, 33), batch_size=32)

with EnergyMeter(log_dir="runs/plain", writer=SummaryWriter("runs/plain"), verbose=False) as meter:
    for epoch in range(2):
        for batch in data:
            loss = torch.nn.functional.mse_loss(model(batch[:, :32]), batch[:, 32:])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            meter.step()                   # the end of one optimizer step
        with meter.loop("val"), torch.no_grad():
            model(torch.randn(256, 32))    # validation: left out of the epoch's training figures
        meter.epoch()                      # the end of an epoch

with EnergyMeter(log_dir="runs/plain_window", verbose=False).window("inference") as used:
    model(torch.randn(4096, 32))
print(f"fit: {meter.report['total_J']:.1f} J; inference: {used.energy_J:.3f} J in {used.duration_s * 1e3:.1f} ms "
      f"({used.provenance}, bound {used.bound_J:.3f} J)")
