"""TensorBoard carries the report: HParams metrics (runs sort by energy), the report table as text, a layout of
loss beside energy in pairs (validation too), all written at fit end or on the output worker."""

from __future__ import annotations

import threading
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from conftest import TinyRegressor, tiny_loader, trainer_kwargs
from lightning_energy import EnergyCallback, SimulatedSensor
from lightning_energy.outputs import tensorboard as tb
from lightning_energy.outputs.tensorboard import custom_scalars_layout, energy_how, hparam_values

DEVICE_W, HOST_W = 120.0, 30.0


class RegressorWithHparams(TinyRegressor):
    def __init__(self, lr: float = 0.01, widths: tuple = (4, 2)) -> None:
        super().__init__()
        self.save_hyperparameters()  # a tuple: Lightning's hparams.yaml gets a !!python/tuple


def sensors():
    return [SimulatedSensor("device", DEVICE_W), SimulatedSensor("host", HOST_W, scope="host")]


def fit_with_tensorboard(tmp_path, version, lr=0.01, **overrides):
    callback = EnergyCallback(sensors=sensors(), verbose=False, interval_s=0.01)
    logger = TensorBoardLogger(str(tmp_path), name="tb", version=version)
    trainer = L.Trainer(callbacks=[callback], logger=logger, **trainer_kwargs(tmp_path, **overrides))
    trainer.fit(RegressorWithHparams(lr=lr), tiny_loader(), tiny_loader(n=48))
    return trainer, callback, logger


def read_events(log_dir):
    """(scalars by tag, hparams plugin contents by tag, text by tag, raw count of each hparams tag)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    hparams = {tag: plugin_data_pb2.HParamsPluginData.FromString(meta.plugin_data.content)
               for tag, meta in acc.summary_metadata.items() if meta.plugin_data.plugin_name == "hparams"}
    texts = {tag: [t.tensor_proto.string_val[0].decode() for t in acc.Tensors(tag)]
             for tag in acc.Tags()["tensors"] if tag.endswith("text_summary")}
    counts: dict[str, int] = {}
    for path in Path(log_dir).glob("events.out.tfevents.*"):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag.startswith("_hparams_/"):
                    counts[value.tag] = counts.get(value.tag, 0) + 1
    return scalars, hparams, texts, counts


def test_hparams_tab_holds_the_energy_totals_and_no_placeholder(tmp_path):
    trainer, callback, logger = fit_with_tensorboard(tmp_path, "a")
    report = callback.report
    scalars, hparams, texts, counts = read_events(trainer.log_dir)
    # one hparams summary per run (TensorBoard keeps the first): ours, not Lightning's hp_metric = -1
    assert counts == {"_hparams_/experiment": 1, "_hparams_/session_start_info": 1, "_hparams_/session_end_info": 1}
    assert "hp_metric" not in scalars
    metrics = [m.name.tag for m in hparams["_hparams_/experiment"].experiment.metric_infos]
    assert metrics[:2] == ["report/energy_total_J", "val/loss"]  # the total first, the loss beside it
    assert set(tb.REPORT_METRICS) <= set(metrics) and "train/loss" in metrics
    for tag, key in tb.REPORT_METRICS.items():
        ((step, value),) = scalars[tag]
        assert step == trainer.global_step and value == pytest.approx(report[key], rel=1e-6)
    assert report["total_J"] == pytest.approx((DEVICE_W + HOST_W) * report["duration_s"], rel=1e-9)
    session = hparams["_hparams_/session_start_info"].session_start_info.hparams
    assert session["lr"].number_value == 0.01 and session["widths"].string_value == "(4, 2)"
    assert session["Energy_how"].string_value == "simulated"
    ((text,),) = texts.values()
    assert f"{report['total_J']:.2f} J" in text and "device" in text and "(simulated)" in text
    assert logger._default_hp_metric is True  # the logger's own setting is back after the fit


def test_runs_sort_by_energy_in_the_hparams_metrics(tmp_path):
    short = fit_with_tensorboard(tmp_path, "short", lr=0.01, max_epochs=1)[1].report["total_J"]
    long = fit_with_tensorboard(tmp_path, "long", lr=0.02, max_epochs=3)[1].report["total_J"]
    totals = {}
    for version in ("short", "long"):
        scalars, _, _, _ = read_events(tmp_path / "tb" / version)
        totals[version] = scalars["report/energy_total_J"][0][1]
    assert totals == pytest.approx({"short": short, "long": long}, rel=1e-6)
    assert sorted(totals, key=totals.get) == ["short", "long"]  # three epochs cost more than one


def test_the_report_is_written_once_at_fit_end_on_the_training_thread_never_per_step(tmp_path, monkeypatch):
    calls = []
    original = tb._write_report

    def spy(writer, params, values, metric_tags, text, step):
        calls.append((threading.current_thread() is threading.main_thread(), step))
        return original(writer, params, values, metric_tags, text, step)

    monkeypatch.setattr(tb, "_write_report", spy)
    trainer, _, _ = fit_with_tensorboard(tmp_path, "once")
    assert calls == [(True, trainer.global_step)]  # one call, after the last step


def test_a_validate_run_keeps_lightnings_own_hparams_behaviour(tmp_path):
    callback = EnergyCallback(sensors=sensors(), verbose=False, interval_s=0.01)
    logger = TensorBoardLogger(str(tmp_path), name="tb", version="val")
    trainer = L.Trainer(callbacks=[callback], logger=logger, **trainer_kwargs(tmp_path))
    trainer.validate(RegressorWithHparams(), tiny_loader(n=48))
    assert logger._default_hp_metric is True


def test_layout_pairs_each_loss_with_its_energy_one_quantity_per_chart():
    layout = custom_scalars_layout(["train/loss"], ["val/loss"])
    training, validation, epochs = layout.values()
    assert list(training) == ["train/loss", "energy per step (J)", "power per step (W)"]
    assert list(validation) == ["val/loss", "validation energy per epoch (J)"]
    assert validation["val/loss"] == ["Multiline", [r"^val/loss$"]]
    for charts in layout.values():
        for kind, regexes in charts.values():
            assert kind == "Multiline" and len(regexes) == 1  # series are runs, coloured as the run legend


def test_tensorboard_layout_in_a_fit_has_the_validation_pair(tmp_path):
    trainer, _, _ = fit_with_tensorboard(tmp_path, "layout")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    acc = EventAccumulator(trainer.log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    layout = layout_pb2.Layout.FromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {c.title: list(c.multiline.tag) for cat in layout.category for c in cat.chart}
    assert charts["val/loss"] == [r"^val/loss$"] and charts["validation energy per epoch (J)"]


def test_energy_how_and_hparam_values():
    assert energy_how({"sensors": [{"estimated": True, "source": "TDP"}, {"estimated": False, "source": "NVML"}]}) \
        == "measured+estimated"  # the provenance module's one order: measured, estimated, simulated
    assert energy_how({"sensors": [{"estimated": False, "source": "x", "provenance": "simulated"}]}) == "simulated"
    assert hparam_values({"a": {"b": 1}, "c": None, "d": [1, 2], "_instantiator": "x", "e": True}) == \
        {"a/b": 1, "c": "None", "d": "[1, 2]", "e": True}
