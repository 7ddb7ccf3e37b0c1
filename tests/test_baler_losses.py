"""Baler's reconstruction loss and the L1 / sparse-KL terms (which must change the gradients)."""

from __future__ import annotations

import math

import pytest
import torch

from baler_lit.errors import BalerInputError
from baler_lit.losses import (
    BalerLoss,
    l1_weight_penalty,
    reconstruction_loss,
    sliced_wasserstein_penalty,
    sparse_kl_penalty,
)
from baler_lit.models import build_model
from baler_conftest_helpers import one_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sum_loss_is_balers_per_batch_sum_over_columns():
    x = torch.rand(8, 24, dtype=torch.float64)
    x_hat = torch.rand(8, 24, dtype=torch.float64)
    expected = ((x_hat - x) ** 2).sum() / 24
    assert torch.allclose(reconstruction_loss(x_hat, x, "sum"), expected)
    assert torch.allclose(reconstruction_loss(x_hat, x, "mean"), ((x_hat - x) ** 2).mean())
    # frames: n_features is the pixel count of one frame
    f, f_hat = torch.rand(3, 5, 4), torch.rand(3, 5, 4)
    assert torch.allclose(reconstruction_loss(f_hat, f, "sum"), ((f_hat - f) ** 2).sum() / 20)


def _grads(model, loss_fn, x):
    model.zero_grad()
    total, recon = loss_fn(model, x)
    total.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, total, recon


def test_l1_weight_regularisation_changes_gradients_by_its_derivative():
    torch.manual_seed(0)
    model = build_model("AE", (24,), dtype="float64")
    x = torch.rand(16, 24, dtype=torch.float64)
    reg = 0.01
    g0, t0, r0 = _grads(model, BalerLoss("sum"), x)
    g1, t1, r1 = _grads(model, BalerLoss("sum", reg_param=reg), x)
    assert torch.equal(r0, r1)
    assert torch.allclose(t1 - r1, reg * l1_weight_penalty(model))
    for name, p in model.named_parameters():
        if name.endswith("weight"):
            expected = reg * torch.sign(p.detach()) / p.numel()
            assert torch.allclose(g1[name] - g0[name], expected, atol=1e-12), name
        else:  # biases are not regularised
            assert torch.allclose(g1[name], g0[name])


def test_sparse_kl_changes_encoder_gradients_only():
    torch.manual_seed(0)
    model = build_model("AE", (24,), dtype="float64")
    x = torch.rand(32, 24, dtype=torch.float64)
    g0, _, _ = _grads(model, BalerLoss("sum"), x)
    g1, t1, r1 = _grads(model, BalerLoss("sum", rho=0.05, kl_weight=0.5), x)
    assert float((t1 - r1).detach()) > 0
    changed = {n for n in g0 if not torch.allclose(g0[n], g1[n])}
    assert changed and all(n.startswith("encoder.") for n in changed)
    assert "encoder.6.weight" in changed  # the layer producing z


def test_sparse_kl_is_zero_at_target_and_positive_elsewhere():
    rho = 0.05
    z_at_target = torch.full((10, 3), math.log(rho / (1 - rho)))  # sigmoid(z) == rho
    assert float(sparse_kl_penalty(z_at_target, rho)) == pytest.approx(0.0, abs=1e-9)
    assert float(sparse_kl_penalty(torch.zeros(10, 3), rho)) > 0.1


@pytest.mark.parametrize(
    "kwargs", [{"reduction": "max"}, {"reg_param": -1.0}, {"rho": 0.0}, {"rho": 1.5}, {"kl_weight": -0.1}]
)
def test_loss_arguments_are_validated(kwargs):
    with pytest.raises(BalerInputError):
        BalerLoss(**kwargs)


def test_swae_penalty_is_balers_compute_swd():
    """Same random draws as Baler's compute_swd (normal projections, standard-normal prior) → same value."""
    z = torch.randn(16, 5, dtype=torch.float64) * 2 + 1
    gen = torch.Generator().manual_seed(7)
    ours = sliced_wasserstein_penalty(z, weight=100.0, power=2.0, n_projections=50, generator=gen)
    gen = torch.Generator().manual_seed(7)
    directions = torch.randn(50, 5, generator=gen, dtype=torch.float64)
    prior = torch.randn(16, 5, generator=gen, dtype=torch.float64)
    proj = (directions / directions.norm(dim=1).view(-1, 1)).transpose(0, 1)  # Baler's get_random_projections
    w_dist = torch.sort((z @ proj).t(), dim=1)[0] - torch.sort((prior @ proj).t(), dim=1)[0]
    expected = 100.0 / (16 * 15) * w_dist.pow(2.0).mean()
    torch.testing.assert_close(ours, expected)


def test_swae_penalty_pulls_codes_towards_the_prior():
    torch.manual_seed(0)
    near = sliced_wasserstein_penalty(torch.randn(256, 4))
    far = sliced_wasserstein_penalty(torch.randn(256, 4) + 3.0)
    assert far > 20 * near
    assert sliced_wasserstein_penalty(torch.randn(1, 4)) == 0  # one sample has no pairs


def test_swae_loss_adds_the_term_and_keeps_balers_reconstruction():
    torch.manual_seed(0)
    model = build_model("AE", (24,))
    x = torch.rand(32, 24)
    total, recon = BalerLoss("swae")(model, x)
    _, plain = BalerLoss("sum")(model, x)
    torch.testing.assert_close(recon, plain)
    assert total > recon
    grads, _, _ = _grads(model, BalerLoss("swae"), x)
    grads_plain, _, _ = _grads(model, BalerLoss("sum"), x)
    assert not torch.allclose(grads["encoder.0.weight"], grads_plain["encoder.0.weight"])
    torch.testing.assert_close(grads["decoder.6.weight"], grads_plain["decoder.6.weight"])  # the term acts on z only
