"""`evaluate` reports per-column errors honestly; `compress` defaults to the demo's latent dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from baler_conftest_helpers import one_thread, quick_trainer, single_thread  # noqa: F401 (fixture)

from baler_lit.cli import _tool_parser
from baler_lit.compression import compress, read_compressed
from baler_lit.data import BalerDataModule
from baler_lit.errors import BalerInputError
from baler_lit.evaluate import column_summaries, error_headline, evaluate, format_summary, overall_error
from baler_lit.module import BalerModule
from baler_lit.table import Table

pytestmark = pytest.mark.usefixtures("one_thread")


def near_zero_tables():
    """Column `wide`: values 0..100, residual +1 everywhere. Column `mostly_zero`: range 0..100 but most values
    0.01, residual +0.05: small against the range, 5x the value itself."""
    n = 1000
    wide = np.linspace(0.0, 100.0, n)
    mostly_zero = np.full(n, 0.01)
    mostly_zero[-1] = 100.0
    original = Table(np.column_stack([wide, mostly_zero]), names=["wide", "mostly_zero"])
    restored = Table(np.column_stack([wide + 1.0, mostly_zero + 0.05]), names=["wide", "mostly_zero"])
    return original, restored


def test_range_relative_errors_are_exact_and_the_near_zero_column_is_flagged_not_hidden():
    original, restored = near_zero_tables()
    wide, zero = column_summaries(original, restored)
    assert wide["norm_rms"] == pytest.approx(0.01) and wide["norm_median_abs"] == pytest.approx(0.01)
    assert zero["norm_median_abs"] == pytest.approx(0.05 / 99.99)
    assert zero["norm_max_abs"] == pytest.approx(0.05 / 99.99)
    assert zero["response_median_abs"] == pytest.approx(5.0)  # relative to the value: 0.05 / 0.01
    assert zero["value_median_abs_over_range"] == pytest.approx(0.01 / 99.99)
    summary = {"columns": [wide, zero], "mean_norm_rms": overall_error(original, restored.data)}
    text = format_summary(summary)
    assert "worst columns by rms/range: wide 0.0100, mostly_zero 0.0005" in text
    assert "mostly_zero: med|r/x| 5, med|r|/range 0.0005, med|x|/range 0.0001" in text
    assert "relative to each column's range" in text
    headline = error_headline(summary)
    assert "worst wide 0.0100" in headline and "mostly_zero (5.00)" in headline


def test_evaluate_writes_one_table_to_tensorboard_not_a_scalar_per_column(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    original, restored = near_zero_tables()
    evaluate(original, restored, tmp_path / "report", tensorboard_dir=tmp_path / "tb")
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    assert events.Tags()["scalars"] == []
    (tag,) = events.Tags()["tensors"]
    table = events.Tensors(tag)[0].tensor_proto.string_val[0].decode()
    assert "| wide | 1 | 0.0100 | 0.0100 | 0.0100 | " in table and "| mostly_zero |" in table


@pytest.fixture
def trained():
    dm = BalerDataModule(synthetic_rows=1500, val_fraction=0.0, batch_size=128)
    torch.manual_seed(0)
    module = BalerModule(input_shape=dm.input_shape)
    with single_thread():
        quick_trainer(max_epochs=1).fit(module, dm)
    return module.eval(), dm.table


def test_compress_defaults_to_float16_the_demos_latent():
    args = _tool_parser().parse_args(["compress", "--ckpt", "c", "--input", "i", "--output", "o"])
    assert args.latent_dtype == "float16"


def test_a_latent_beyond_float16s_range_is_refused_with_the_fix(trained, tmp_path):
    module, table = trained
    with torch.no_grad():
        module.model.encoder[-1].bias.add_(1e6)  # a latent far beyond ±65504
    out = tmp_path / "big.baler"
    with pytest.raises(BalerInputError, match=r"not finite in float16, .*use --latent-dtype bfloat16 or float32"):
        compress(module.model, module.normalizer, table, out, "float16", dict(module.hparams))
    assert not out.exists()
    result = compress(module.model, module.normalizer, table, out, "float32", dict(module.hparams))
    assert bool(torch.isfinite(read_compressed(out).latent).all()) and result.latent_dtype == "float32"
