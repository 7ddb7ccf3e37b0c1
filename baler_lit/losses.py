"""Baler's reconstruction loss and the two regularisers Baler configures but never applies.

All values are dimensionless: inputs are min-max normalised.

- ``"sum"`` (Baler's loss, per batch): ``Σ (x̂ − x)² / n_features`` summed over the batch and every feature,
  so it grows with the batch size (a full batch of 512 rows gives 512× the per-row mean).
- ``"mean"``: the plain mean squared error over all elements.
- L1 weight regularisation (``reg_param``): ``reg_param · Σ_layers mean(|W|)`` over the weight matrices and
  convolution kernels (biases and norm layers excluded). Baler sums a per-layer mean too, but never adds it.
- Sparse KL on the latent code (``rho``): ``kl_weight · Σ_j KL(rho ‖ rho_hat_j)`` with
  ``rho_hat_j = mean_batch(sigmoid(z_j))``, the classic sparse-autoencoder penalty.
- ``"swae"``: Baler's ``loss_function_swae``: the ``"sum"`` reconstruction plus the sliced-Wasserstein
  distance between the batch's latent codes and as many draws of a standard-normal prior, over
  ``swd_projections`` random unit directions (Baler: 2000, power 2), weighted ``swd_weight / (B·(B−1))``
  (Baler: 100) for a batch of B samples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .errors import BalerInputError

RECONSTRUCTIONS = ("sum", "mean", "swae")
#: Baler's ``loss_function_swae`` defaults: weight, Wasserstein power, number of random projections.
SWD_WEIGHT = 100.0
SWD_POWER = 2.0
SWD_PROJECTIONS = 2000
#: Keeps ``rho_hat`` away from 0 and 1 so the KL term stays finite.
KL_EPS = 1e-6


def reconstruction_loss(x_hat: torch.Tensor, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    """Baler's per-batch ``Σ(x̂−x)²/n_features`` (``"sum"``/``"swae"``) or the element mean (``"mean"``)."""
    if reduction in ("sum", "swae"):
        return F.mse_loss(x_hat, x, reduction="sum") / x[0].numel()
    if reduction == "mean":
        return F.mse_loss(x_hat, x)
    raise BalerInputError(f"loss must be one of {RECONSTRUCTIONS}, got {reduction!r}")


def l1_weight_penalty(model: nn.Module) -> torch.Tensor:
    """``Σ_layers mean(|W|)`` over Linear weights and (transposed) convolution kernels."""
    terms = [
        m.weight.abs().mean()
        for m in model.modules()
        if isinstance(m, (nn.Linear, nn.Conv2d, nn.ConvTranspose2d, nn.Conv3d, nn.ConvTranspose3d))
    ]
    if not terms:
        raise BalerInputError("L1 weight regularisation needs a model with Linear or Conv layers")
    return torch.stack(terms).sum()


def sparse_kl_penalty(z: torch.Tensor, rho: float) -> torch.Tensor:
    """``Σ_j KL(rho ‖ rho_hat_j)`` with ``rho_hat_j`` the batch mean of ``sigmoid(z_j)``."""
    rho_hat = torch.sigmoid(z).mean(dim=0).clamp(KL_EPS, 1.0 - KL_EPS)
    return (rho * torch.log(rho / rho_hat) + (1.0 - rho) * torch.log((1.0 - rho) / (1.0 - rho_hat))).sum()


def sliced_wasserstein_penalty(
    z: torch.Tensor,
    weight: float = SWD_WEIGHT,
    power: float = SWD_POWER,
    n_projections: int = SWD_PROJECTIONS,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Baler's ``compute_swd``: ``weight/(B·(B−1)) · mean |sort(z·P) − sort(prior·P)|^power``.

    ``P`` holds ``n_projections`` random unit directions (columns) drawn from a normal distribution, ``prior``
    ``B`` draws of a standard normal in the latent space; both are drawn afresh per call (from ``generator``
    when given). A batch of one sample has no pairs (B·(B−1) = 0): the penalty is 0 then.
    """
    batch, latent = z.shape[0], z.shape[1]
    if batch < 2:
        return z.new_zeros(())
    kw = {"dtype": z.dtype, "device": z.device}
    if generator is not None:
        directions = torch.randn(n_projections, latent, generator=generator, **kw)
        prior = torch.randn(batch, latent, generator=generator, **kw)
    else:
        directions = torch.randn(n_projections, latent, **kw)
        prior = torch.randn(batch, latent, **kw)
    directions = directions / directions.norm(dim=1, keepdim=True)
    proj = directions.t()
    gap = torch.sort((z @ proj).t(), dim=1).values - torch.sort((prior @ proj).t(), dim=1).values
    return weight / (batch * (batch - 1)) * gap.abs().pow(power).mean()


class BalerLoss(nn.Module):
    """Reconstruction loss plus the optional L1-weight and sparse-KL terms.

    Args:
        reduction: ``"sum"`` (Baler), ``"mean"`` or ``"swae"`` (``"sum"`` + Baler's sliced-Wasserstein term).
        reg_param: weight of the L1 weight penalty; 0 disables it (Baler's configured value is 0.001).
        rho: target mean activation of the latent units for the sparse-KL term; ``None`` disables it
            (Baler's configured value is 0.05).
        kl_weight: weight of the sparse-KL term.
        swd_weight, swd_projections: weight and number of projections of the ``"swae"`` term (Baler: 100, 2000).
    """

    def __init__(
        self,
        reduction: str = "sum",
        reg_param: float = 0.0,
        rho: float | None = None,
        kl_weight: float = 1.0,
        swd_weight: float = SWD_WEIGHT,
        swd_projections: int = SWD_PROJECTIONS,
    ) -> None:
        super().__init__()
        if reduction not in RECONSTRUCTIONS:
            raise BalerInputError(f"loss must be one of {RECONSTRUCTIONS}, got {reduction!r}")
        if reg_param < 0:
            raise BalerInputError(f"reg_param must be >= 0, got {reg_param}")
        if rho is not None and not 0.0 < rho < 1.0:
            raise BalerInputError(f"rho must be in (0, 1) or null, got {rho}")
        if kl_weight < 0:
            raise BalerInputError(f"kl_weight must be >= 0, got {kl_weight}")
        if swd_weight < 0 or swd_projections < 1:
            raise BalerInputError(f"swd_weight must be >= 0 and swd_projections >= 1, got {swd_weight}, {swd_projections}")
        self.reduction = reduction
        self.swd_weight = float(swd_weight)
        self.swd_projections = int(swd_projections)
        self.reg_param = float(reg_param)
        self.rho = None if rho is None else float(rho)
        self.kl_weight = float(kl_weight)

    def forward(self, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``model`` on ``x``; return ``(total loss to minimise, reconstruction loss)``."""
        z = model.encode(x)
        recon = reconstruction_loss(model.decode(z), x, self.reduction)
        total = recon
        if self.reg_param > 0:
            total = total + self.reg_param * l1_weight_penalty(model)
        if self.rho is not None and self.kl_weight > 0:
            total = total + self.kl_weight * sparse_kl_penalty(z, self.rho)
        if self.reduction == "swae" and self.swd_weight > 0:
            total = total + sliced_wasserstein_penalty(z.flatten(1), self.swd_weight, n_projections=self.swd_projections)
        return total, recon
