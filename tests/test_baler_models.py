"""Model shapes, the latent-size rule, layer layout and the MAC count of Baler's AE."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from baler_lit.errors import BalerInputError
from baler_lit.models import AE, AE_Dropout_BN, ConvAE, PJ_Conv_AE, build_model, latent_size
from baler_conftest_helpers import one_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

#: MACs of the AE forward pass for one batch of 512 rows, bias adds counted once per output unit
#: (reference table in ../shared/CONTEXT.md, section Baler).
BALER_AE_MACS_BATCH_512 = 31_283_939


@pytest.mark.parametrize(
    ("n", "ratio", "z"), [(24, 1.6, 15), (24, 1.0, 24), (40, 2.0, 20), (41, 2.0, 21), (2500, 50.0, 50), (3, 10.0, 1)]
)
def test_latent_size_rule(n, ratio, z):
    assert latent_size(n, ratio) == z


@pytest.mark.parametrize(("n", "ratio"), [(0, 1.6), (24, 0.0), (24, -1.0)])
def test_latent_size_rejects_bad_arguments(n, ratio):
    with pytest.raises(BalerInputError):
        latent_size(n, ratio)


def _linear_sizes(seq: nn.Sequential) -> list[tuple[int, int]]:
    return [(m.in_features, m.out_features) for m in seq if isinstance(m, nn.Linear)]


def test_ae_layer_sizes_activations_and_shapes():
    model = build_model("AE", (24,), compression_ratio=1.6)
    assert isinstance(model, AE)
    assert _linear_sizes(model.encoder) == [(24, 200), (200, 100), (100, 50), (50, 15)]
    assert _linear_sizes(model.decoder) == [(15, 50), (50, 100), (100, 200), (200, 24)]
    acts = [m for m in model.modules() if isinstance(m, nn.LeakyReLU)]
    assert len(acts) == 6 and all(a.negative_slope == 0.01 for a in acts)
    # no activation on the latent code or on the output
    assert isinstance(model.encoder[-1], nn.Linear) and isinstance(model.decoder[-1], nn.Linear)
    x = torch.rand(7, 24)
    assert model.encode(x).shape == (7, 15)
    assert model(x).shape == (7, 24)


def test_ae_mac_count_matches_baler_reference():
    model = build_model("AE", (24,), compression_ratio=1.6)
    batch = 512
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    macs = sum(batch * m.in_features * m.out_features + m.out_features for m in linears)
    assert macs == BALER_AE_MACS_BATCH_512


def test_sizes_follow_the_data():
    model = build_model("AE", (40,), compression_ratio=2.0)
    assert _linear_sizes(model.encoder)[0] == (40, 200) and model.latent_dim == 20
    assert build_model("AE", (40,), latent_dim=7).latent_dim == 7


def test_ae_dropout_bn_layout():
    model = build_model("AE_Dropout_BN", (24,), compression_ratio=1.6)
    assert isinstance(model, AE_Dropout_BN)
    drops = [m.p for m in model.encoder if isinstance(m, nn.Dropout)]
    assert drops == [0.5, 0.4, 0.3, 0.2]
    norms = [m.num_features for m in model.decoder if isinstance(m, nn.BatchNorm1d)]
    assert norms == [50, 100, 200, 24]
    model.eval()
    assert model(torch.rand(5, 24)).shape == (5, 24)


@pytest.mark.parametrize("shape", [(50, 50), (37, 23), (1, 50, 50), (2, 16, 9)])
def test_conv_ae_runs_on_frames_of_any_shape(shape):
    model = build_model("ConvAE", shape, compression_ratio=50.0)
    assert isinstance(model, ConvAE)
    x = torch.rand(3, *shape)
    z = model.encode(x)
    assert z.shape == (3, model.latent_dim)
    assert model(x).shape == x.shape


def test_conv_ae_on_cfd_frames_sizes():
    model = build_model("ConvAE", (50, 50), compression_ratio=50.0)
    assert model.latent_dim == 50
    assert model.flat_size == 16 * 7 * 7  # 50 → 25 → 13 → 7 with channels (8, 16, 16)


def test_float64_models():
    model = build_model("AE", (24,), dtype="float64")
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert model(torch.rand(2, 24, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.parametrize(
    ("name", "shape", "message"),
    [("AE", (50, 50), "use CFD_dense_AE, ConvAE"), ("ConvAE", (24,), "use AE"), ("nope", (24,), "unknown model")],
)
def test_model_shape_errors_name_the_problem(name, shape, message):
    with pytest.raises(BalerInputError, match=message):
        build_model(name, shape)


def test_bad_dtype_is_rejected():
    with pytest.raises(BalerInputError, match="dtype"):
        build_model("AE", (24,), dtype="float16")


# -- Baler's other models, sized from the data ------------------------------------------------------------------
def test_cfd_dense_ae_takes_and_returns_frames_with_balers_layer_sizes():
    model = build_model("CFD_dense_AE", (50, 50), compression_ratio=100)  # Baler's CFD example: 2500 → 25
    assert _linear_sizes(model.encoder) == [(2500, 200), (200, 100), (100, 50), (50, 25)]
    assert _linear_sizes(model.decoder) == [(25, 50), (50, 100), (100, 200), (200, 2500)]
    x = torch.rand(4, 50, 50)
    z = model.encode(x)
    assert z.shape == (4, 25) and model.decode(z).shape == (4, 50, 50)
    flat = AE((2500,), 25)
    flat.load_state_dict(model.state_dict())  # same layers as AE on hand-flattened frames
    torch.testing.assert_close(model(x), flat(x.flatten(1)).unflatten(1, (50, 50)))


def test_pj_conv_ae_matches_the_original_on_28x28_and_sizes_itself_for_other_frames():
    model = build_model("PJ_Conv_AE", (28, 28), latent_dim=10)
    assert isinstance(model, PJ_Conv_AE) and model.flat_size == 50 * 7 * 7  # the original's hard-coded size
    assert _linear_sizes(model.encoder) == [(2450, 500), (500, 10)]
    assert _linear_sizes(model.decoder) == [(10, 500), (500, 2450)]
    convs = [(m.in_channels, m.out_channels, m.kernel_size, m.stride) for m in model.modules()
             if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d))]  # fmt: skip
    assert convs == [(1, 20, (5, 5), (2, 2)), (20, 50, (5, 5), (2, 2)), (50, 20, (5, 5), (2, 2)), (20, 1, (5, 5), (2, 2))]
    for shape in [(28, 28), (50, 50), (37, 23), (2, 16, 9)]:
        m = build_model("PJ_Conv_AE", shape, compression_ratio=10.0)
        assert m(torch.rand(3, *shape)).shape == (3, *shape)
    with pytest.raises(BalerInputError, match="frames"):
        build_model("PJ_Conv_AE", (24,))


@pytest.mark.parametrize("shape", [(24,), (50, 50), (2, 8, 9)])
def test_transformer_ae_codes_each_sample_on_its_own(shape):
    torch.manual_seed(0)
    model = build_model("TransformerAE", shape, compression_ratio=4.0).eval()
    x = torch.rand(5, *shape)
    with torch.no_grad():
        z = model.encode(x)
        assert z.shape == (5, model.latent_dim) and model.decode(z).shape == (5, *shape)
        # the original attends across the rows of a batch; here a row's code does not depend on its neighbours
        torch.testing.assert_close(model.encode(x[2:3]), z[2:3], rtol=1e-5, atol=1e-6)


def test_transformer_ae_learns():
    torch.manual_seed(0)
    model = build_model("TransformerAE", (24,), compression_ratio=1.6)
    x = torch.rand(64, 24)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):  # 0.25 x is passed at step 122, 150 steps reach 0.17 x (seed 0)
        loss = torch.nn.functional.mse_loss(model(x), x)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    mean_only = float(((x - x.mean(0)) ** 2).mean())  # the error of predicting each column's mean
    assert float(loss.detach()) < 0.25 * mean_only  # it reconstructs rows, not just the average row


def test_transformer_ae_rejects_heads_that_do_not_divide_the_width():
    with pytest.raises(BalerInputError, match="divisible"):
        build_model("TransformerAE", (24,), model_kwargs={"d_model": 30, "n_heads": 4})
