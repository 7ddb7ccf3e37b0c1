"""Lightning Trainer: one callback. Energy per step and epoch beside the loss, a report at the end."""

import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_energy import EnergyCallback

trainer = L.Trainer(max_epochs=2, callbacks=[EnergyCallback()], default_root_dir="runs/trainer",
                    enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=8)
trainer.fit(BoringModel())
print(f"{trainer.callbacks[0].report['total_J']:.1f} J; report in {trainer.callbacks[0].report_path}")
