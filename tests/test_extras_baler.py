"""baler-lit without its extra's packages: one line and exit code 2, nothing written (issue 32 item 1)."""

from __future__ import annotations

import numpy as np
import pytest

from baler_lit.cli import main
from lightning_energy.extras import MissingExtra


@pytest.fixture
def without(monkeypatch):
    def hide(*modules):
        import sys

        for name in modules:
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                monkeypatch.delitem(sys.modules, loaded)
            monkeypatch.setitem(sys.modules, name, None)
    return hide


def test_evaluate_without_matplotlib_says_which_extra_and_writes_nothing(tmp_path, without, capsys):
    data = np.random.default_rng(0).normal(size=(64, 4))
    np.savez(tmp_path / "a.npz", data=data)
    np.savez(tmp_path / "b.npz", data=data + 0.01)
    without("matplotlib")
    rc = main(["evaluate", "--original", str(tmp_path / "a.npz"), "--restored", str(tmp_path / "b.npz"),
               "--out", str(tmp_path / "report")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "matplotlib" in err[0] and "lightning-energy[baler]" in err[0]
    assert not (tmp_path / "report").exists()
    assert main(["evaluate", "--original", str(tmp_path / "a.npz"), "--restored", str(tmp_path / "b.npz"),
                 "--out", str(tmp_path / "report"), "--no-plots"]) == 0  # the numbers need no extra


def test_reading_a_root_file_without_uproot_names_the_extra(tmp_path, without):
    from baler_lit.root_files import open_root

    without("uproot")
    with pytest.raises(MissingExtra, match=r"lightning-energy\[baler\]"):
        open_root(tmp_path / "x.root")


def test_fit_without_jsonargparse_is_one_line(without, capsys):
    without("jsonargparse")
    assert main(["fit", "--config", "cms_ae"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "jsonargparse" in err[0] and "lightning-energy[baler]" in err[0]
