"""Model shapes, the latent-size rule, layer layout and the MAC count of Baler's AE."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from baler_lit.errors import BalerInputError
from baler_lit.models import AE, AE_Dropout_BN, ConvAE, build_model, latent_size
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
