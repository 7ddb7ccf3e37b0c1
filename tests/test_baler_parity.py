"""Features a Baler user relies on: training on every row, plain .npz integer columns, type_list, dtypes in the
checkpoint, default_root_dir, the checkpoint callback, file tools without Lightning, diagnose."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from baler_conftest_helpers import REPO, one_thread, quick_trainer, single_thread  # noqa: F401 (fixture)

from lightning.pytorch.strategies import SingleDeviceStrategy

from baler_lit.cli import load_checkpoint, logger_dir_note, main
from baler_lit.data import BalerDataModule
from baler_lit.errors import BalerInputError
from baler_lit.module import BalerCheckpoint, BalerModule
from baler_lit.sources import load_npz
from baler_lit.synthetic import FLOAT_COLUMNS, INT_COLUMNS, synthetic_cms_jets
from baler_lit.table import Table, infer_column_dtypes, save_npz

pytestmark = pytest.mark.usefixtures("one_thread")

CMS_CONFIG = REPO / "configs" / "cms_ae.yaml"
PARITY_CONFIG = REPO / "configs" / "baler_parity.yaml"


def _plain_npz(path, table: Table) -> None:
    """Baler's own layout: float64 ``data`` and ``names``, no dtypes."""
    np.savez(path, data=table.data.astype(np.float64), names=np.array(table.names))


@pytest.fixture(scope="module")
def all_rows_fit(tmp_path_factory):
    """`baler-lit fit --config configs/cms_ae.yaml --data.val_fraction 0 --trainer.default_root_dir ROOT` run
    from another working directory; returns (root, cwd, data file)."""
    root = tmp_path_factory.mktemp("root")
    cwd = tmp_path_factory.mktemp("cwd")
    data = root / "jets.npz"
    save_npz(data, synthetic_cms_jets(600, seed=3))
    with pytest.MonkeyPatch.context() as mp, single_thread():
        mp.chdir(cwd)
        mp.setattr(sys, "argv", ["baler-lit"])
        code = main(["fit", "--config", str(CMS_CONFIG), "--trainer.default_root_dir", str(root),
                     "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                     "--data.path", str(data), "--data.val_fraction", "0", "--data.batch_size", "128",
                     "--trainer.max_epochs", "3"])  # fmt: skip
    assert code == 0
    return root, cwd, data


def test_training_on_every_row_still_saves_the_best_checkpoint(all_rows_fit):
    root, _, _ = all_rows_fit
    ckpt_path = root / "lightning_logs" / "version_0" / "checkpoints" / "best.ckpt"
    raw = torch.load(ckpt_path, weights_only=True)
    assert raw["hyper_parameters"]["monitor"] == "auto"
    states = [v for k, v in raw.items() if k == "callbacks"]  # weights-only file: no callback states
    assert states == [] and raw["epoch"] == 2  # loss falls on every early epoch: the last one is the best
    assert load_checkpoint(ckpt_path).model.latent_dim == 15


def test_default_root_dir_moves_logs_checkpoints_and_reports(all_rows_fit):
    root, cwd, _ = all_rows_fit
    run = root / "lightning_logs" / "version_0"
    assert any(p.name.startswith("events.out.tfevents") for p in run.iterdir())
    assert (run / "energy_report.json").is_file() and (run / "checkpoints" / "best.ckpt").is_file()
    assert list(cwd.iterdir()) == []  # nothing written below the working directory (the old runs/cms_ae)


def test_a_logger_with_its_own_save_dir_is_noted():
    logger = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": "elsewhere"}}
    note = logger_dir_note({"default_root_dir": "runs/x", "logger": logger})
    assert note is not None and "elsewhere" in note and "runs/x" in note
    assert logger_dir_note({"default_root_dir": "runs/x", "logger": None}) is None
    same = {"class_path": "x", "init_args": {"save_dir": "runs/x"}}
    assert logger_dir_note({"default_root_dir": "runs/x", "logger": [same]}) is None


def test_baler_parity_overlay_sets_balers_defaults():
    parity = yaml.safe_load(PARITY_CONFIG.read_text())
    model, data = parity["model"], parity["data"]
    assert (model["dtype"], model["lr"], model["loss"], model["lr_factor"], model["lr_patience"]) == (
        "float64", 0.001, "sum", 0.5, 50,
    )  # fmt: skip
    assert model["early_stopping_patience"] == 100 and model["reg_param"] == 0.0
    assert (data["batch_size"], data["shuffle"], data["val_fraction"]) == (512, False, 0.0)
    module = BalerModule(input_shape=(24,), **model)
    dm = BalerDataModule(synthetic_rows=64, **data)
    assert module.model.latent_dim == 15 and next(module.parameters()).dtype == torch.float64
    assert not dm.has_validation


# -- integer columns and dtypes ------------------------------------------------------------------------------
def test_integer_valued_columns_of_a_plain_npz_are_detected(tmp_path):
    table = synthetic_cms_jets(500, seed=4)
    _plain_npz(tmp_path / "plain.npz", table)
    loaded = load_npz(tmp_path / "plain.npz")
    assert loaded.dtypes_inferred
    assert loaded.dtypes == ["float64"] * len(FLOAT_COLUMNS) + ["int64"] * len(INT_COLUMNS)
    # float32 storage detects as int32; values beyond float32's exact-integer range stay floats
    values = np.array([[1.0, 2.5], [2.0**25, 3.0]], dtype=np.float32)
    assert infer_column_dtypes(values, frames=False) == ["float32", "float32"]
    assert infer_column_dtypes(values[:1], frames=False) == ["int32", "float32"]
    frames = np.arange(2 * 3 * 4, dtype=np.float64).reshape(2, 3, 4)
    assert infer_column_dtypes(frames, frames=True) == ["int64"]


@pytest.fixture(scope="module")
def trained_with_dtypes(tmp_path_factory):
    """A checkpoint trained on a file WITH dtypes (15 float32 + 9 int32), and the same data without them."""
    tmp = tmp_path_factory.mktemp("dtypes")
    table = synthetic_cms_jets(800, seed=5)
    save_npz(tmp / "typed.npz", table)
    _plain_npz(tmp / "plain.npz", table)
    with single_thread():
        dm = BalerDataModule(str(tmp / "typed.npz"), val_fraction=0.0, batch_size=200)
        module = BalerModule(input_shape=dm.input_shape)
        quick_trainer(max_epochs=40).fit(module, dm)
        trainer = quick_trainer(max_epochs=0)
        trainer.strategy.connect(module)
        trainer.save_checkpoint(tmp / "model.ckpt", weights_only=True)
    return tmp, table


def _ratio(capsys, argv) -> float:
    assert main(argv) == 0
    return float(re.search(r"ratio ([0-9.]+)", capsys.readouterr().out).group(1))


def test_plain_npz_integer_columns_are_restored_rounded_and_ratio_ignores_metadata(trained_with_dtypes, tmp_path,
                                                                                   capsys):  # fmt: skip
    src, table = trained_with_dtypes
    ckpt = str(src / "model.ckpt")
    assert load_checkpoint(ckpt).column_dtypes == table.dtypes  # the training dtypes travel in the checkpoint
    typed = _ratio(capsys, ["compress", "--ckpt", ckpt, "--input", str(src / "typed.npz"),
                            "--output", str(tmp_path / "typed.baler")])  # fmt: skip
    plain = _ratio(capsys, ["compress", "--ckpt", ckpt, "--input", str(src / "plain.npz"),
                            "--output", str(tmp_path / "plain.baler")])  # fmt: skip
    assert plain == typed
    assert main(["decompress", "--input", str(tmp_path / "plain.baler"), "--output", str(tmp_path / "r.npz")]) == 0
    with np.load(tmp_path / "r.npz", allow_pickle=False) as npz:
        ints = npz["data"][:, len(FLOAT_COLUMNS) :]
        assert list(npz["dtypes"]) == table.dtypes
    np.testing.assert_array_equal(ints, np.round(ints))
    exact = np.mean(ints == table.data[:, len(FLOAT_COLUMNS) :])
    assert exact > 0.2  # trained 40 epochs: many rounded multiplicities are exactly right (about 0.44 here)


def test_type_list_sets_the_column_dtypes(tmp_path):
    table = synthetic_cms_jets(300, seed=6)
    _plain_npz(tmp_path / "plain.npz", table)
    type_list = ["float64"] * 12 + ["int"] * 12
    dm = BalerDataModule(str(tmp_path / "plain.npz"), type_list=type_list)
    assert dm.table.dtypes == ["float64"] * 12 + ["int64"] * 12 and not dm.table.dtypes_inferred
    with pytest.raises(BalerInputError, match="24 columns"):
        BalerDataModule(str(tmp_path / "plain.npz"), type_list=["int"] * 3).table
    with pytest.raises(BalerInputError, match="not numeric|unknown"):
        BalerDataModule(str(tmp_path / "plain.npz"), type_list=["str"] * 24).table


# -- the checkpoint callback -----------------------------------------------------------------------------------
class ScriptedLoss(L.LightningModule):
    """One weight that grows by 1 per epoch; ``train/loss`` follows a script (so the best epoch is known)."""

    def __init__(self, losses: list[float], fail_at: int | None = None) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))
        self.losses = losses
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        if self.current_epoch == self.fail_at:
            raise RuntimeError("scripted failure")
        with torch.no_grad():
            self.w += 1.0
        self.log("train/loss", self.losses[self.current_epoch], on_epoch=True, on_step=False)
        return (self.w * 0.0).sum()  # zero gradient: only the scripted in-place update moves the weight

    def train_dataloader(self):
        return [torch.zeros(1)]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_checkpoint_holds_the_best_epoch_and_writes_once(tmp_path, monkeypatch):
    writes = []
    original = L.Trainer.save_checkpoint

    def count(self, *a, **k):
        writes.append(a)
        return original(self, *a, **k)

    monkeypatch.setattr(L.Trainer, "save_checkpoint", count)
    ckpt = BalerCheckpoint(dirpath=tmp_path, filename="best", write_interval_s=3600)
    module = ScriptedLoss([5.0, 2.0, 1.0, 3.0, 4.0])
    trainer = quick_trainer(max_epochs=5, enable_checkpointing=True, callbacks=[ckpt])
    saved = []
    monkeypatch.setattr(SingleDeviceStrategy, "save_checkpoint", lambda self, c, p, **k: saved.append(p)
                        or torch.save(c, p))  # fmt: skip
    trainer.fit(module)
    assert ckpt.monitor == "train/loss" and float(ckpt.best_model_score) == 1.0
    assert len(saved) == 1 and writes == []  # one write, at the end of the fit
    best = torch.load(tmp_path / "best.ckpt", weights_only=True)
    assert best["epoch"] == 2 and "optimizer_states" not in best
    torch.testing.assert_close(best["state_dict"]["w"], torch.full((3,), 3.0))  # weights after epoch 2
    assert float(module.w[0].detach()) == 5.0  # the module moved on


def test_checkpoint_writes_the_pending_best_when_the_fit_fails(tmp_path):
    ckpt = BalerCheckpoint(dirpath=tmp_path, filename="best", write_interval_s=3600)
    trainer = quick_trainer(max_epochs=5, enable_checkpointing=True, callbacks=[ckpt])
    with pytest.raises(RuntimeError, match="scripted failure"):
        trainer.fit(ScriptedLoss([3.0, 1.0, 2.0, 0.5, 0.1], fail_at=3))
    best = torch.load(tmp_path / "best.ckpt", weights_only=True)
    assert best["epoch"] == 1
    torch.testing.assert_close(best["state_dict"]["w"], torch.full((3,), 2.0))


def test_checkpoint_with_no_interval_writes_every_best(tmp_path):
    ckpt = BalerCheckpoint(dirpath=tmp_path, filename="best", write_interval_s=0)
    quick_trainer(max_epochs=3, enable_checkpointing=True, callbacks=[ckpt]).fit(ScriptedLoss([3.0, 1.0, 2.0]))
    full = torch.load(tmp_path / "best.ckpt", weights_only=True)
    assert full["epoch"] == 1 and "loops" in full  # ModelCheckpoint's own full checkpoint


# -- file tools without Lightning, diagnose ----------------------------------------------------------------------
def test_compress_and_decompress_never_import_lightning(trained_with_dtypes, tmp_path):
    src, _ = trained_with_dtypes
    script = (
        "import sys\n"
        "from baler_lit.cli import main\n"
        f"assert main(['compress', '--ckpt', {str(src / 'model.ckpt')!r}, '--input', {str(src / 'plain.npz')!r},"
        f" '--output', {str(tmp_path / 'x.baler')!r}]) == 0\n"
        f"assert main(['decompress', '--input', {str(tmp_path / 'x.baler')!r}, '--output',"
        f" {str(tmp_path / 'x.npz')!r}]) == 0\n"
        "print('LIGHTNING', sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "LIGHTNING []" in proc.stdout
    assert (tmp_path / "x.npz").is_file()


def test_diagnose_writes_per_layer_activation_statistics(trained_with_dtypes, tmp_path, capsys):
    src, table = trained_with_dtypes
    out, tb = tmp_path / "diag", tmp_path / "tb"
    assert main(["diagnose", "--ckpt", str(src / "model.ckpt"), "--input", str(src / "typed.npz"), "--out", str(out),
                 "--tensorboard", str(tb)]) == 0  # fmt: skip
    assert "latent" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    layers = summary["layers"]
    assert [r["nodes"] for r in layers] == [200, 100, 50, 15, 50, 100, 200, 24]
    assert [r["layer"] for r in layers][3] == "latent" and layers[-1]["layer"] == "output"
    trained = load_checkpoint(src / "model.ckpt")
    x = torch.from_numpy(trained.normalizer.transform(table.data, np.float32))
    with torch.no_grad():
        z = trained.model.encode(x)
        first_hidden = trained.model.encoder[:2](x)
    np.testing.assert_allclose(layers[3]["node_means"], z.double().mean(0).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layers[0]["node_means"], first_hidden.double().mean(0).numpy(), rtol=1e-5, atol=1e-6)
    assert layers[0]["inactive_fraction"] == pytest.approx(float((first_hidden <= 0).double().mean()), abs=1e-9)
    assert (out / "diagnostics.png").stat().st_size > 10_000
    assert any(p.name.startswith("events.out.tfevents") for p in tb.iterdir())


@pytest.mark.parametrize(("name", "shape"), [("CFD_dense_AE", (12, 10)), ("PJ_Conv_AE", (12, 10)), ("TransformerAE", (6,))])
def test_new_models_round_trip_through_a_baler_file(name, shape, tmp_path):
    from baler_lit.compression import compress, decompress
    from baler_lit.models import build_model
    from baler_lit.normalization import MinMaxNormalizer

    torch.manual_seed(0)
    data = np.random.default_rng(0).random((20, *shape))
    model = build_model(name, shape, compression_ratio=2.0).eval()
    norm = MinMaxNormalizer.fit(data, per_column=len(shape) == 1)
    compress(model, norm, Table(data), tmp_path / "x.baler")
    restored = decompress(tmp_path / "x.baler")  # the decoder is rebuilt from the file alone
    with torch.no_grad():
        direct = model(torch.from_numpy(norm.transform(data, np.float32))).double().numpy()
    np.testing.assert_allclose(restored.data, norm.inverse(direct), rtol=1e-3, atol=1e-3)
