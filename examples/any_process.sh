#!/usr/bin/env bash
# Any process: measure a command you did not write (here a plain training script; the original Baler CLI,
# a torchrun job of another framework work the same way). Same report, trace and events as a fit.
set -euo pipefail
lightning-energy monitor --out runs/monitor -- python -c '
import torch
model = torch.nn.Linear(32, 1)
for epoch in range(2):
    for step in range(20):
        model(torch.randn(256, 32)).sum().backward()
        print("lightning-energy: step", flush=True)
    print("lightning-energy: epoch", flush=True)
'
