"""Files that name a model or declare an array size are trust boundaries (issue 29, items 1, 4 and 7b).

- A checkpoint whose hyper-parameters declare layers far larger than its weights is refused, in one line with
  exit code 2, before the model is built: the runs below are child processes under ``RLIMIT_AS`` (the fuzz
  runner's ``CLI_WRAPPER``: the address space after the imports plus ``MEMORY_HEADROOM``), where building the
  declared model fails to allocate.
- ``evaluate`` reads an ``.npz`` the way ``compress`` does: headers first (checked against the bytes each member
  holds), a deflated member inflated block by block, so a zip bomb of zeros or a header declaring a huge shape
  is one line and exit code 2, not gigabytes of memory or an allocation traceback.
- ``evaluate --tensorboard`` on a path that cannot be a folder is refused before anything is written.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from baler_fuzz import CLI_WRAPPER, CODE, MEMORY_HEADROOM

from baler_lit.cli import main
from baler_lit.models import build_model
from baler_lit.synthetic import synthetic_cms_jets
from baler_lit.table import save_npz

#: Rows of the honest tables (synthetic jets: 24 columns).
ROWS = 600
#: Rows the zip bomb declares: 2.2 M rows x 24 float64 columns = 422 MB inflated, above ``MEMORY_HEADROOM``
#: (256 MiB), about 0.4 MB on disk.
BOMB_ROWS = 2_200_000


def run_limited(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """``baler-lit ARGV`` in a child process whose address space may grow by ``MEMORY_HEADROOM`` after its imports."""
    env = {**os.environ, "PYTHONPATH": str(CODE), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", CLI_WRAPPER, str(MEMORY_HEADROOM), *argv], capture_output=True,
                          text=True, env=env, timeout=300, cwd=cwd)  # fmt: skip


def assert_one_line_refusal(rc: int, stderr: str, command: str, *words: str) -> str:
    lines = stderr.strip().splitlines()
    assert rc == 2 and len(lines) == 1, (rc, stderr[-2000:])
    assert lines[0].startswith(f"baler-lit {command}: error: "), lines
    for word in words:
        assert word in lines[0], lines
    return lines[0]


@pytest.fixture(scope="module")
def honest_npz(tmp_path_factory) -> Path:
    return save_npz(tmp_path_factory.mktemp("honest") / "jets.npz", synthetic_cms_jets(ROWS, seed=3))


# -- item 1: crafted checkpoints -----------------------------------------------------------------------------
def crafted_checkpoint(path: Path, weights_of: dict, declared: dict, weights_dtype=torch.float32) -> Path:
    """A checkpoint holding the weights of ``build_model(**weights_of)`` (in ``weights_dtype``) and
    hyper-parameters ``declared``."""
    torch.manual_seed(0)
    model = build_model(**weights_of).to(weights_dtype)
    n = model.n_features
    torch.save(
        {
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "hyper_parameters": declared,
            "baler": {"norm_min": [0.0] * n, "norm_scale": [1.0] * n, "names": [f"col_{i}" for i in range(n)],
                      "dtypes": ["float64"] * n},
        },
        path,
    )  # fmt: skip
    return path


TINY_AE = {"name": "AE", "input_shape": (24,), "latent_dim": 2, "model_kwargs": {"hidden": [3]}}
BALER_AE = {"name": "AE", "input_shape": (24,), "latent_dim": 15}  # Baler's n->200->100->50->z: 61,839 values
HUGE_HIDDEN = {"input_shape": [24], "model": "AE", "latent_dim": 15, "model_kwargs": {"hidden": [60000, 60000, 50]}}
CHECKPOINTS = {
    # the case: 48 stored values, a model of 2 x 60000 x 60000 weights (29 GB) declared
    "tiny weights, huge hidden layers": (TINY_AE, HUGE_HIDDEN, "declares a size of 60000"),
    # every declared number below the stored count: the meta-device blueprint finds the mismatch
    "Baler AE weights, huge hidden layers": (BALER_AE, HUGE_HIDDEN, "'encoder.0.weight'"),
    "a billion transformer layers": (
        {"name": "TransformerAE", "input_shape": (24,), "latent_dim": 2},
        {"input_shape": [24], "model": "TransformerAE", "latent_dim": 2, "model_kwargs": {"n_layers": 10**9}},
        "declares a size of 1000000000",
    ),
}


@pytest.mark.parametrize("case", CHECKPOINTS)
def test_checkpoint_declaring_a_larger_model_than_its_weights_is_refused_before_it_is_built(
    tmp_path, honest_npz, case
):
    weights_of, declared, words = CHECKPOINTS[case]
    ckpt = crafted_checkpoint(tmp_path / "crafted.ckpt", weights_of, declared)
    output = tmp_path / "out.baler"
    result = run_limited("compress", "--ckpt", str(ckpt), "--input", str(honest_npz), "--output", str(output),
                         cwd=tmp_path)  # fmt: skip
    line = assert_one_line_refusal(result.returncode, result.stderr, "compress", f"checkpoint {ckpt}", words)
    assert "allocate" not in line  # refused from the description, not by running out of memory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["crafted.ckpt"]


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.float64])  # float64: a "64-true" run's weights
def test_honest_checkpoint_still_compresses(tmp_path, honest_npz, weights_dtype):
    declared = {"input_shape": [24], "model": "AE", "latent_dim": 15}
    ckpt = crafted_checkpoint(tmp_path / "honest.ckpt", BALER_AE, declared, weights_dtype)
    assert main(["compress", "--ckpt", str(ckpt), "--input", str(honest_npz), "--output",
                 str(tmp_path / "out.baler")]) == 0  # fmt: skip


# -- item 4: npz inputs of evaluate ---------------------------------------------------------------------------
def npz_with_member(path: Path, header: dict, body_chunks, compression: int = zipfile.ZIP_DEFLATED) -> Path:
    """An npz whose ``data.npy`` member has the npy ``header`` and then the bytes of ``body_chunks``."""
    with zipfile.ZipFile(path, "w", compression) as zf, zf.open("data.npy", "w", force_zip64=True) as fh:
        np.lib.format.write_array_header_1_0(fh, header)
        for chunk in body_chunks:
            fh.write(chunk)
    return path


@pytest.fixture(scope="module")
def zip_bomb(tmp_path_factory) -> Path:
    """A deflated npz member of zeros: 422 MB of float64 in about 0.4 MB on disk."""
    row_chunk = bytes(24 * 8 * 100_000)
    chunks = (row_chunk for _ in range(BOMB_ROWS // 100_000))
    header = {"descr": "<f8", "fortran_order": False, "shape": (BOMB_ROWS, 24)}
    return npz_with_member(tmp_path_factory.mktemp("bomb") / "bomb.npz", header, chunks)


@pytest.mark.parametrize("restored", ["honest", "the bomb too"])
def test_evaluate_does_not_inflate_a_zip_bomb(tmp_path, zip_bomb, honest_npz, restored):
    assert zip_bomb.stat().st_size < 2 * 2**20
    report = tmp_path / "report"
    other = honest_npz if restored == "honest" else zip_bomb
    result = run_limited("evaluate", "--original", str(zip_bomb), "--restored", str(other), "--out", str(report),
                         "--no-plots", cwd=tmp_path)  # fmt: skip
    # against an honest file: the row counts differ, said from the headers; against itself: 422 MB to hold
    words = ("row-count mismatch",) if restored == "honest" else ("bytes in memory",)
    assert_one_line_refusal(result.returncode, result.stderr, "evaluate", str(zip_bomb), *words)
    assert list(tmp_path.iterdir()) == []


HUGE_SHAPE = (10**12, 12)  # 87.3 TiB of float64


@pytest.mark.parametrize("compression", [zipfile.ZIP_DEFLATED, zipfile.ZIP_STORED])
@pytest.mark.parametrize("role", ["--original", "--restored"])
def test_evaluate_refuses_an_npz_header_declaring_a_huge_shape(tmp_path, capsys, honest_npz, role, compression):
    header = {"descr": "<f8", "fortran_order": False, "shape": HUGE_SHAPE}
    liar = npz_with_member(tmp_path / "liar.npz", header, [bytes(8 * 24 * 10)], compression)
    inputs = {"--original": str(honest_npz), "--restored": str(honest_npz), role: str(liar)}
    rc = main(["evaluate", *(x for pair in inputs.items() for x in pair), "--out", str(tmp_path / "report"),
               "--no-plots"])  # fmt: skip
    assert_one_line_refusal(rc, capsys.readouterr().err, "evaluate", str(liar), "more than the file holds")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["liar.npz"]


def test_evaluate_refuses_names_declaring_a_huge_shape(tmp_path, capsys, honest_npz):
    with np.load(honest_npz) as npz:
        data = npz["data"]
    liar = tmp_path / "liar.npz"
    with zipfile.ZipFile(liar, "w", zipfile.ZIP_DEFLATED) as zf:
        with zf.open("data.npy", "w") as fh:
            np.lib.format.write_array(fh, data)
        with zf.open("names.npy", "w") as fh:
            np.lib.format.write_array_header_1_0(fh, {"descr": "<U100", "fortran_order": False, "shape": (10**12,)})
            fh.write(bytes(400 * 24))
    rc = main(["evaluate", "--original", str(liar), "--restored", str(honest_npz), "--out", str(tmp_path / "r")])
    assert_one_line_refusal(rc, capsys.readouterr().err, "evaluate", str(liar), "'names'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["liar.npz"]


# -- item 7b: --tensorboard on a file --------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["the path", "its parent"])
def test_evaluate_refuses_a_tensorboard_path_that_is_a_file_before_writing(tmp_path, capsys, honest_npz, where):
    blocker = tmp_path / "events"
    blocker.write_text("not a folder")
    tensorboard = blocker if where == "the path" else blocker / "run1"
    rc = main(["evaluate", "--original", str(honest_npz), "--restored", str(honest_npz), "--out",
               str(tmp_path / "report"), "--tensorboard", str(tensorboard), "--no-plots"])  # fmt: skip
    assert rc == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["events"]  # no report folder left
    assert_one_line_refusal(rc, capsys.readouterr().err, "evaluate", f"{blocker} is not a folder")
    assert blocker.read_text() == "not a folder"
