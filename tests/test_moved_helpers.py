"""Helpers moved down the layers (issue 27) keep one definition, served where their users read them."""

from __future__ import annotations

import pytest
import torch


def test_rank_gpu_lives_in_gpu_control_and_names_its_caller():
    from lightning_energy.optimize.power_limit.gpu_control import rank_gpu

    with pytest.raises(RuntimeError, match=r"^BatchSizeSearch needs a GPU's power limits \(NVIDIA, or AMD on ROCm\), "
                                           r"but this rank trains on cpu\. .*SimulatedGPU"):
        rank_gpu(torch.device("cpu"), "BatchSizeSearch")
    with pytest.raises(RuntimeError, match=r"^PowerLimitOptimizer needs"):
        rank_gpu(torch.device("cpu"))


def test_one_definition_of_each_moved_helper():
    from lightning_energy import fitting, io
    from lightning_energy.analysis import fit
    from lightning_energy.filenames import REPORT_FILE
    from lightning_energy.outputs import report, worker

    assert worker.describe_error is io.describe_error
    assert io.describe_error(OSError(28, "No space left on device")) == "OSError: [Errno 28] No space left on device"
    assert fit.quadratic_fit is fitting.quadratic_fit and fit.QuadraticFit is fitting.QuadraticFit
    assert report.REPORT_FILE == REPORT_FILE == "energy_report.json"


def test_baler_checkpoint_reader_is_served_by_the_cli_too():
    from baler_lit import checkpoint, cli

    assert cli.load_checkpoint is checkpoint.load_checkpoint and cli.TrainedModel is checkpoint.TrainedModel


def test_an_unknown_example_name_is_refused_before_any_search(monkeypatch):
    from baler_lit import examples
    from baler_lit.errors import BalerInputError
    from baler_lit.sources import load_table

    monkeypatch.setattr(examples, "search_dirs", lambda: pytest.fail("searched for an unknown example"))
    with pytest.raises(BalerInputError, match="unknown example 'nope'; known: CFD_animation, CFD_still"):
        load_table("example:nope")


def test_a_found_example_file_is_read_as_baler_s_npz(tmp_path, monkeypatch):
    import numpy as np

    from baler_lit.sources import load_table

    data = np.linspace(0.0, 1.0, 50 * 50).reshape(1, 50, 50)
    np.savez(tmp_path / "CFD_still.npz", data=data)
    monkeypatch.setenv("BALER_LIT_DATA", str(tmp_path))
    table = load_table("example:CFD_still")
    np.testing.assert_array_equal(table.data, data)
