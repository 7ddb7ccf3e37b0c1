"""CompileModel: ``torch.compile`` a LightningModule's layers from a config, a lever of ``lightning-energy recommend``."""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override


class CompileModel(Callback):
    """Compile, in place, each direct sub-module of the LightningModule that holds parameters.

    ``nn.Module.compile`` keeps the module object (its parameters, state dict and checkpoint keys stay as
    they were) and routes its calls through ``torch.compile``; ``training_step`` code that calls
    ``self.model(x)`` or ``self.encoder(x)`` then runs the compiled graph. Sub-modules without parameters
    (a loss) are left alone. Compiling happens once, at the start of ``fit``, and its cost (seconds on a
    CPU, where inductor builds C++ kernels) is part of the fit's energy: a short run can lose by it.

    Args:
        mode: ``torch.compile``'s mode (``None``, ``"default"``, ``"reduce-overhead"``, ``"max-autotune"``).
        backend: ``torch.compile``'s backend (default ``"inductor"``).
    """

    def __init__(self, mode: str | None = None, backend: str = "inductor") -> None:
        super().__init__()
        self.mode, self.backend = mode, backend
        self.compiled: list[str] = []  # names of the sub-modules compiled

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != TrainerFn.FITTING or self.compiled:
            return
        for name, child in pl_module.named_children():
            if any(True for _ in child.parameters()):
                child.compile(mode=self.mode, backend=self.backend)
                self.compiled.append(name)
