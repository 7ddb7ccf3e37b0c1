"""FLOPs/MACs tables (hand-computed counts, the Baler study's table), the peak table, FlopsCallback."""

from __future__ import annotations

import csv
import io

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from conftest import TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy import SimulatedSensor
from lightning_energy.callbacks.flops import TABLE_FILE, FlopsCallback
from lightning_energy.predict.flops import OTHER_ROW, count_model, study_macs
from lightning_energy.predict.peaks import (
    CORRECTIONS, GPU_BENCH_MIN_SIZE, GPU_BENCH_SIZE, device_peak, gpu_bench_size, gpu_peak, measured_peak, precision_of,
)

# The Baler profiling study's MAC table: one forward pass of the AE on a batch of 512, bias adds counted.
STUDY_ENCODER = [2_457_800, 10_240_100, 2_560_050, 384_015]
STUDY_DECODER = [384_050, 2_560_100, 10_240_200, 2_457_624]
STUDY_TOTAL = 31_283_939


def baler_ae(n_columns: int = 24, latent: int = 15) -> nn.Sequential:
    """Baler's AE: encoder 24-200-100-50-z, decoder z-50-100-200-24, LeakyReLU between layers."""

    def stack(sizes):
        layers = []
        for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.LeakyReLU(0.01))
        return nn.Sequential(*layers)

    sizes = [n_columns, 200, 100, 50, latent]
    return nn.Sequential(stack(sizes), stack(sizes[::-1]))


def linear_rows(table):
    return [row for row in table.rows if row.kind == "Linear"]


# ------------------------------------------------------------------------------ hand-computed FLOPs
def test_linear_flops_equal_hand_computed_values():
    model = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 4, bias=False))
    table = count_model(model, torch.randn(3, 7))
    first, relu, second = table.rows
    assert (first.name, relu.name, second.name) == ("0", "1", "2")
    assert first.forward_FLOPs == 2 * 3 * 7 * 5 and first.forward_MACs == 3 * 7 * 5
    assert first.backward_FLOPs == 2 * 3 * 7 * 5  # weight gradient only: the input needs no gradient
    assert second.forward_FLOPs == 2 * 3 * 5 * 4
    assert second.backward_FLOPs == 2 * (2 * 3 * 5 * 4)  # gradients of its input and of its weight
    assert relu.forward_FLOPs == 0 and relu.params == 0
    assert first.params == 7 * 5 + 5 and second.params == 5 * 4
    assert first.study_MACs == 3 * 7 * 5 + 5 and second.study_MACs == 3 * 5 * 4  # no bias: nothing added
    assert table.params == 7 * 5 + 5 + 5 * 4
    assert table.train_FLOPs == table.forward_FLOPs + table.backward_FLOPs == 210 + 120 + 210 + 240
    assert table.batch_size == 3


@pytest.mark.parametrize(
    "conv, shape, out_positions, per_position",
    [
        (nn.Conv2d(3, 4, 3), (2, 3, 8, 8), 2 * 6 * 6, 3 * 3 * 3 * 4),
        (nn.Conv2d(4, 8, 3, stride=2, padding=1), (1, 4, 9, 9), 1 * 5 * 5, 3 * 3 * 4 * 8),
        (nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2), (1, 4, 9, 9), 1 * 5 * 5, 3 * 3 * 2 * 8),
        (nn.Conv1d(2, 3, 5), (4, 2, 10), 4 * 6, 5 * 2 * 3),
    ],
)
def test_conv_flops_equal_hand_computed_values(conv, shape, out_positions, per_position):
    table = count_model(conv, torch.randn(shape))
    row = table.rows[0]
    macs = out_positions * per_position
    assert row.forward_MACs == macs and row.forward_FLOPs == 2 * macs
    # weight gradient only (the input needs none); FlopCounterMode leaves groups out of it
    assert row.backward_FLOPs == 2 * macs * conv.groups
    assert row.study_MACs == macs + conv.out_channels * out_positions  # ptflops: bias per output element
    assert row.params == sum(p.numel() for p in conv.parameters())


def test_study_macs_of_other_layers_is_zero():
    assert study_macs(nn.LeakyReLU(), (512, 200), (512, 200)) == 0
    assert study_macs(nn.BatchNorm1d(4), (8, 4), (8, 4)) == 0


# ------------------------------------------------------------------------------ the Baler study's table
def test_study_table_is_reproduced_for_the_ae_at_batch_512():
    table = count_model(baler_ae(), torch.randn(512, 24))
    rows = linear_rows(table)
    assert [r.study_MACs for r in rows] == STUDY_ENCODER + STUDY_DECODER
    assert [r.name for r in rows] == ["0.0", "0.2", "0.4", "0.6", "1.0", "1.2", "1.4", "1.6"]
    assert table.study_MACs == STUDY_TOTAL
    assert "31,283,939" in table.format() and "31,283,939" in table.markdown()


@pytest.mark.parametrize("batch, latent", [(1, 15), (100, 15), (1024, 15), (512, 8), (512, 24), (64, 3)])
def test_study_table_scales_with_batch_size_and_latent_size(batch, latent):
    table = count_model(baler_ae(latent=latent), torch.randn(batch, 24))
    sizes = [24, 200, 100, 50, latent]
    pairs = list(zip(sizes, sizes[1:])) + list(zip(sizes[::-1], sizes[::-1][1:]))
    assert [r.study_MACs for r in linear_rows(table)] == [batch * a * b + b for a, b in pairs]
    if latent == 15:  # the products scale with the batch, the 739 bias adds do not
        bias_adds = sum(b for _, b in pairs)
        assert bias_adds == 739
        assert table.study_MACs == (STUDY_TOTAL - bias_adds) * batch // 512 + bias_adds


def test_count_model_leaves_gradients_and_buffers_untouched():
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    table = count_model(model, torch.randn(8, 4) * 5 + 3)
    assert all(p.grad is None for p in model.parameters())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert table.row("1").kind == "BatchNorm1d" and table.row("1").params == 12


def test_functional_ops_outside_layers_land_in_the_other_row():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4, 3))

        def forward(self, x):
            return self.proj(x) @ self.scale  # a matrix product of the module itself

    table = count_model(Head(), torch.randn(5, 4))
    other = table.row(OTHER_ROW)
    assert other.forward_FLOPs == 2 * 5 * 4 * 3 and other.params == 12
    assert table.forward_FLOPs == 2 * 5 * 4 * 4 + 2 * 5 * 4 * 3


def test_csv_table_has_one_row_per_layer():
    table = count_model(baler_ae(), torch.randn(512, 24))
    rows = list(csv.DictReader(io.StringIO(table.csv_text())))
    assert len(rows) == len(table.rows) == 14
    assert sum(int(r["study_MACs"]) for r in rows) == STUDY_TOTAL
    assert rows[0]["input_shape"] == "512x24" and rows[0]["dtype"] == "float32"


# ------------------------------------------------------------------------------ peaks
@pytest.fixture
def gpu_named(monkeypatch):
    """A CUDA device that answers to a given name (Hopper's compute capability): no GPU needed."""
    def name(value):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: value)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        return torch.device("cuda", 0)
    return name


@pytest.mark.parametrize(
    "name, precision, tflops",
    [
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0), ("NVIDIA A100-PCIE-40GB", "bf16", 312.0),
        ("NVIDIA H100 80GB HBM3", "fp16", 989.4), ("NVIDIA H100 80GB HBM3", "fp32", 66.9),
        ("NVIDIA H100 PCIe", "fp32", 51.2), ("Tesla V100-SXM2-16GB", "fp16", 125.0),
        ("Tesla V100-PCIE-32GB", "fp32", 14.0), ("Tesla T4", "fp16", 65.0), ("NVIDIA L4", "tf32", 60.0),
        # cards the project's own table never had
        ("NVIDIA GeForce RTX 4090", "bf16", 82.6), ("NVIDIA A10G", "tf32", 62.5), ("NVIDIA RTX A6000", "fp32", 38.7),
    ],
)
def test_gpu_peaks_come_from_lightnings_table(gpu_named, name, precision, tflops):
    from lightning.fabric.utilities.throughput import get_available_flops

    peak = gpu_peak(gpu_named(name), precision)
    assert peak.flops_per_s == pytest.approx(tflops * 1e12)
    assert not peak.measured and "Lightning's get_available_flops" in peak.source and peak.device == name
    expected = get_available_flops(torch.device("cuda", 0), "tfloat32" if precision == "tf32" else
                                   {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision])
    assert peak.flops_per_s == expected  # the very figure Lightning gives


def test_fp32_peak_is_not_lightnings_tf32_figure_while_tf32_is_on(gpu_named):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # Lightning would then answer float32 with the TF32 rate
    try:
        device = gpu_named("NVIDIA A100-SXM4-80GB")
        assert gpu_peak(device, "fp32").flops_per_s == pytest.approx(19.5e12)
        assert gpu_peak(device, "tf32").flops_per_s == pytest.approx(156e12)
        assert torch.get_float32_matmul_precision() == "high"  # restored
    finally:
        torch.set_float32_matmul_precision(before)


def test_corrections_where_lightnings_table_is_wrong(gpu_named):
    from lightning.fabric.utilities.throughput import get_available_flops

    h200 = gpu_peak(gpu_named("NVIDIA H200"), "bf16")  # Lightning: unknown name
    assert h200.flops_per_s == pytest.approx(989.5e12) and "dense" in h200.source
    with pytest.warns(UserWarning, match="FLOPs not found"):
        assert get_available_flops(torch.device("cuda", 0), torch.bfloat16) is None
    device = gpu_named("NVIDIA L40S")
    assert get_available_flops(device, torch.float32) == pytest.approx(30.3e12)  # Lightning: the L4's rate
    assert gpu_peak(device, "fp32") is None  # measured instead
    assert gpu_peak(gpu_named("NVIDIA H100 NVL"), "bf16") is None
    assert gpu_peak(gpu_named("NVIDIA H200 NVL"), "fp32") is None
    assert gpu_peak(gpu_named("Tesla T4"), "bf16") is None  # Turing has no BF16
    assert gpu_peak(gpu_named("Some Future GPU"), "fp32") is None
    assert {label for _, label, _, _ in CORRECTIONS} == {"H100/H200 NVL", "H200", "L40/L40S"}
    with pytest.raises(ValueError, match="precision must be one of"):
        gpu_peak(device, "fp8")


def test_gpu_fallback_product_is_large_and_fits_in_free_memory():
    gib = 1024**3
    assert gpu_bench_size(80 * gib, 4) == GPU_BENCH_SIZE == 8192  # 0.8 GB of 80 GB free
    assert gpu_bench_size(80 * gib, 8) == 8192
    n = gpu_bench_size(1 * gib, 4)  # a quarter of 1 GiB for three float32 matrices
    assert n == 4608 and 3 * n * n * 4 <= gib / 4 < 3 * (n + 256) ** 2 * 4
    assert gpu_bench_size(10 * 1024**2, 2) == GPU_BENCH_MIN_SIZE  # never launch-bound small
    assert 2 * GPU_BENCH_SIZE**3 / 1e15 / 5e-6 > 200  # the full size: 220x a 5 us launch at 1 PFLOP/s


def test_precision_follows_the_trainer():
    assert precision_of("tf32", "cuda") == "tf32" and precision_of("16-mixed-noscale") == "fp16"  # plugin modes
    assert precision_of("bf16-mixed") == "bf16"
    assert precision_of("16-mixed") == "fp16"
    assert precision_of("64-true") == "fp64"
    assert precision_of("32-true", "cpu") == "fp32"


def test_cpu_peak_is_measured_once_per_process():
    first = measured_peak("fp32", "cpu", size=64, repeats=2)
    assert first > 1e6  # a matrix product runs faster than a megaflop per second on any CPU
    assert measured_peak("fp32", "cpu", size=64, repeats=2) == first  # cached, not re-measured
    peak = device_peak("cpu", "fp32")
    assert peak.measured and "measured" in peak.source and peak.flops_per_s > 1e6
    with pytest.raises(ValueError, match="size >= 16"):
        measured_peak("fp32", "cpu", size=4)


# ------------------------------------------------------------------------------ FlopsCallback in a fit
POWER_W = 80.0
PEAK = 1e9


def tensorboard(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_flops_callback_logs_table_rate_mfu_and_energy_per_gflop(tmp_path):
    callback = FlopsCallback(peak_flops_per_s=PEAK, sensors=[SimulatedSensor("device", POWER_W)])
    trainer = L.Trainer(callbacks=[callback], logger=TensorBoardLogger(str(tmp_path), name="tb"),
                        **trainer_kwargs(tmp_path, max_epochs=2))
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    table = callback.table
    assert table.batch_size == 16 and table.forward_FLOPs == 2 * 16 * 16 and table.backward_FLOPs == 2 * 16 * 16
    per_sample = table.train_FLOPs / 16
    first, second = callback.epochs
    assert first["flops/epoch_GFLOP"] == pytest.approx(per_sample * (160 - 16) / 1e9)  # counted step left out
    assert second["flops/epoch_GFLOP"] == pytest.approx(per_sample * 160 / 1e9)
    for row in callback.epochs:
        rate = row["flops/epoch_GFLOP"] * 1e9 / row["steps_s"]
        assert row["flops/rate_GFLOP_per_s"] == pytest.approx(rate / 1e9)
        assert row["flops/mfu"] == pytest.approx(rate / PEAK)
        assert row["energy/J_per_GFLOP"] == pytest.approx(POWER_W / (rate / 1e9), rel=1e-9)
    rows = list(csv.DictReader(io.StringIO((tmp_path / "tb" / "version_0" / TABLE_FILE).read_text())))
    assert rows[0]["layer"] == "layer" and int(rows[0]["forward_FLOPs"]) == 512
    acc = tensorboard(trainer.log_dir)
    assert "flops/table/text_summary" in acc.Tags()["tensors"]
    scalars = set(acc.Tags()["scalars"])
    assert {"flops/mfu", "flops/rate_GFLOP_per_s", "energy/J_per_GFLOP", "flops/epoch_GFLOP"} <= scalars
    # logged through the loggers (not pl_module.log: the figures arrive after the epoch), at the epoch's last step
    mfu = acc.Scalars("flops/mfu")
    assert [e.step for e in mfu] == [9, 19]
    assert [e.value for e in mfu] == pytest.approx([first["flops/mfu"], second["flops/mfu"]], rel=1e-6)
    hparams = trainer.logger.hparams
    assert hparams["flops/train_GFLOP_per_batch"] == pytest.approx(table.train_FLOPs / 1e9)
    assert hparams["flops/peak_TFLOP_per_s"] == pytest.approx(PEAK / 1e12) and hparams["flops/params"] == 17


def test_example_input_counts_at_fit_start_and_measures_every_step(tmp_path):
    callback = FlopsCallback(example_input=torch.randn(32, 16), peak_flops_per_s=PEAK,
                             sensors=[SimulatedSensor("device", POWER_W)])
    trainer = L.Trainer(callbacks=[callback], logger=False, **trainer_kwargs(tmp_path, max_epochs=1))
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    assert callback.table.batch_size == 32
    assert callback.epochs[0]["flops/epoch_GFLOP"] == pytest.approx(callback.table.train_FLOPs / 32 * 160 / 1e9)


# ------------------------------------------------------------------------------ the study's table on baler_lit's AE
def test_study_table_is_reproduced_for_baler_lits_own_ae():
    from baler_lit.models import AE

    model = AE(input_shape=(24,), latent_dim=15)
    dtype = next(model.parameters()).dtype
    table = count_model(model, torch.randn(512, 24, dtype=dtype))
    rows = linear_rows(table)
    assert [r.name for r in rows] == [f"{part}.{i}" for part in ("encoder", "decoder") for i in (0, 2, 4, 6)]
    assert [r.study_MACs for r in rows] == STUDY_ENCODER + STUDY_DECODER  # CONTEXT.md's reference table
    assert table.study_MACs == STUDY_TOTAL == 31_283_939
    assert table.forward_MACs == STUDY_TOTAL - 739  # the same products without the bias additions
    assert table.params == sum(p.numel() for p in model.parameters()) and table.batch_size == 512


# ------------------------------------------------------------------------------ estimated energy is labelled
@pytest.mark.parametrize("estimated", [False, True], ids=["measured", "estimated"])
def test_energy_per_gflop_is_labelled_an_estimate_when_the_sensors_are(tmp_path, estimated, caplog):
    import logging

    callback = FlopsCallback(peak_flops_per_s=PEAK, sensors=[SimulatedSensor("device", POWER_W),
                                                             SimulatedSensor("cpu", 10.0, estimated=estimated)])
    trainer = L.Trainer(callbacks=[callback], logger=TensorBoardLogger(str(tmp_path), name="tb"),
                        **trainer_kwargs(tmp_path, max_epochs=2))
    with caplog.at_level(logging.INFO):
        trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    assert callback.energy_estimated is estimated and callback.estimated_sensors == (["cpu"] if estimated else [])
    assert [row["energy_estimated"] for row in callback.epochs] == [estimated, estimated]
    assert trainer.logger.hparams["flops/energy_estimated"] is estimated
    text = tensorboard(trainer.log_dir).Tensors("flops/table/text_summary")[0].tensor_proto.string_val[0].decode()
    label = "energy/J_per_GFLOP: ESTIMATED (sensors cpu are estimates)" if estimated else "energy/J_per_GFLOP: measured"
    assert label in text
    infos = [r.getMessage() for r in caplog.records if "energy/J_per_GFLOP is an estimate" in r.getMessage()
             and r.name == "lightning_energy.callbacks.flops"]  # the library's own logger
    assert infos == (["FlopsCallback: sensors ['cpu'] are estimates, not measurements, so energy/J_per_GFLOP is an "
                      "estimate (flops/energy_estimated = True)"] if estimated else [])
    for row in callback.epochs:  # the figure itself is the same either way: both sensors are summed
        rate = row["flops/epoch_GFLOP"] * 1e9 / row["steps_s"]
        assert row["energy/J_per_GFLOP"] == pytest.approx((POWER_W + 10.0) / (rate / 1e9), rel=1e-9)


# ------------------------------------------------------------------------------ MFU follows the precision mode
PEAKS = {"fp32": 2e9, "bf16": 8e9}


@pytest.fixture
def fixed_peaks(monkeypatch):
    """Known peaks per precision instead of the CPU measurement."""
    from lightning_energy.predict.peaks import Peak

    monkeypatch.setattr("lightning_energy.callbacks.flops.device_peak",
                        lambda device, precision: Peak(PEAKS[precision], precision, str(device), "test table", False))


def test_mfu_follows_the_precision_switch(tmp_path, fixed_peaks):
    from lightning_energy.callbacks.precision import PrecisionSwitch
    from precision_helpers import FollowMode, ModePowerSensor

    # 32-true is cheaper: chosen after profiling (a name of its own: "device" is the FlopsCallback's sensor)
    sensor = ModePowerSensor({"32-true": 5.0, "bf16-mixed": 500.0}, name="mode_power")  # 100x: beyond step jitter
    switch = PrecisionSwitch(candidates=["32-true", "bf16-mixed"], warmup_steps=1, profile_steps=2, probe=False,
                             sensors=[sensor], interval_s=0.002, verbose=False)
    callback = FlopsCallback(sensors=[SimulatedSensor("device", POWER_W)])
    trainer = L.Trainer(callbacks=[callback, switch, FollowMode(sensor, 0.02)], logger=False,
                        **trainer_kwargs(tmp_path, max_epochs=2))
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    assert [(e["from"], e["to"], e["step"]) for e in switch.switches] == [("32-true", "bf16-mixed", 3),
                                                                         ("bf16-mixed", "32-true", 6)]
    per_sample_GFLOP = callback.table.train_FLOPs / 16 / 1e9
    first, second = callback.epochs
    # epoch 0: steps 1-2 and 6-9 in float32 (step 0 was counted, not measured), steps 3-5 in bfloat16
    assert first["GFLOP_by_precision"] == pytest.approx({"fp32": 6 * 16 * per_sample_GFLOP,
                                                          "bf16": 3 * 16 * per_sample_GFLOP})
    assert second["GFLOP_by_precision"] == pytest.approx({"fp32": 10 * 16 * per_sample_GFLOP})
    for row in callback.epochs:
        ideal_s = sum(gflop * 1e9 / PEAKS[name] for name, gflop in row["GFLOP_by_precision"].items())
        assert row["flops/mfu"] == pytest.approx(ideal_s / row["steps_s"], rel=1e-12)
    assert second["flops/mfu"] == pytest.approx(second["flops/rate_GFLOP_per_s"] * 1e9 / PEAKS["fp32"])
    assert set(callback.peaks) == {"fp32", "bf16"} and callback.peak.precision == "fp32"


def test_the_peak_at_fit_start_is_that_of_a_fixed_mode_set_up_after_the_callback(tmp_path, fixed_peaks):
    from lightning_energy.callbacks.precision import PrecisionSwitch

    callback = FlopsCallback(sensors=[SimulatedSensor("device", POWER_W)])
    switch = PrecisionSwitch(mode="bf16-mixed", sensors=[SimulatedSensor("device", POWER_W)], verbose=False)
    trainer = L.Trainer(callbacks=[callback, switch], logger=TensorBoardLogger(str(tmp_path), name="tb"),
                        **trainer_kwargs(tmp_path, max_epochs=1))
    trainer.fit(TinyRegressor(), tiny_loader(), tiny_loader(n=48))
    assert callback.peak.precision == "bf16" and set(callback.peaks) == {"bf16"}
    assert trainer.logger.hparams["flops/peak_TFLOP_per_s"] == pytest.approx(PEAKS["bf16"] / 1e12)
    (row,) = callback.epochs
    assert row["flops/mfu"] == pytest.approx(row["flops/rate_GFLOP_per_s"] * 1e9 / PEAKS["bf16"])
