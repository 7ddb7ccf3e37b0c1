"""The fuzzer as a test (issue 29): a seeded sample of a few hundred hostile inputs over every file command.

``tests/baler_fuzz.py`` builds the attacks (mutated ``.baler`` files for ``decompress``, ``info`` and
``evaluate --compressed``; crafted checkpoints for ``compress``; crafted ``.npz`` files for ``compress --input``
and ``evaluate``; re-signed corrections and constants that do not fit their columns) and runs them in one child
process under an address-space limit. Every case must end in a good outcome: refused with one line and exit
code 2 and nothing written, or (only where the mutation can leave a valid input) accepted with valid output;
never a traceback, a signal, an allocation beyond the limit, stray files, values the column's dtype cannot
hold, or a peak RSS beyond twice the honest input's. ``benchmarks/fuzz.py`` runs thousands.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from baler_conftest_helpers import one_thread  # noqa: F401 (fixture)
from baler_fuzz import GOOD, build_all_cases, class_table, format_class_table, restored_data_problem, run_all

pytestmark = pytest.mark.usefixtures("one_thread")
SEED = 29
SAMPLE = 320
#: The cases of issue 29, always in the sample (the rest is drawn at random)
ISSUE_CASES = [
    'ckpt: hyper-parameter model_kwargs = {"hidden": [60000, 60000, 50]} [compress]',
    "npz: deflate bomb in data.npy [evaluate --original]",
    "npz: header declares shape (1000000000000, 24) [evaluate --original]",
    "values: every correction = 1e+300 [decompress]",
    "values: every correction = 0.5 [decompress]",
    "values: constant column = 0.5 [decompress]",
    "values: constant column = 1e+300 [decompress]",
]


@pytest.fixture(scope="module")
def fuzz_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz-all")
    honest, cases = build_all_cases(folder / "files", SEED, n_random=20)
    slow = [n for n in cases if n.startswith("npz: deflate bomb") and n.endswith("[compress --input]")]
    drawn = random.Random(SEED).sample(sorted(set(cases) - set(ISSUE_CASES) - set(slow)), SAMPLE - len(ISSUE_CASES))
    sample = {name: cases[name] for name in ISSUE_CASES + drawn}
    results, verdicts, honest_rss = run_all(sample, honest, folder / "run")
    return sample, results, verdicts, honest_rss


def test_honest_inputs_pass_under_the_limit(fuzz_run):
    _, results, verdicts, honest_rss = fuzz_run
    honest = {n: v for n, v in verdicts.items() if n.startswith("honest")}
    assert len(honest) == 8 and set(honest.values()) == {"accepted: rc 0, valid output"}, honest
    assert all(rss > 0 for rss in honest_rss.values()), honest_rss


def test_sample_covers_every_command_and_input_kind(fuzz_run):
    sample, *_ = fuzz_run
    commands = {case.command for case in sample.values()}
    assert commands == {"decompress", "info", "evaluate", "compress", "compress --input", "evaluate --original",
                        "evaluate --restored"}
    kinds = {name.split(":")[0] for name in sample if name.startswith(("ckpt:", "npz:", "values:"))}
    assert kinds == {"ckpt", "npz", "values"} and len(sample) >= 300


def test_every_hostile_input_has_a_good_outcome(fuzz_run):
    sample, results, verdicts, _ = fuzz_run
    wrong = {name: (verdicts[name], (results.get(name) or {}).get("crash"),
                    (results.get(name) or {}).get("bad_data"), (results.get(name) or {}).get("stderr", "")[-240:])
             for name in sample if verdicts[name] not in GOOD}
    report = format_class_table(class_table({n: verdicts[n] for n in wrong}, results)) if wrong else ""
    assert not wrong, f"{len(wrong)} of {len(sample)} cases:\n{report}\n" + "\n".join(map(str, wrong.items()))


def test_written_data_check_catches_values_the_column_dtype_cannot_hold(tmp_path):
    """The check behind "bad data written": inf in a float32 column, 0.5 or 3e9 in an int32 column."""
    from baler_lit.table import write_npz

    good = np.array([[1.5, 2.0], [3.25, -4.0]])
    assert restored_data_problem(write_npz(tmp_path / "ok.npz", good, ["a", "b"], ["float32", "int32"])) is None
    for value, column in ((np.inf, 0), (1e300, 0), (0.5, 1), (3e9, 1)):
        data = good.copy()
        data[0, column] = value
        path = write_npz(tmp_path / f"bad{value}.npz", data, ["a", "b"], ["float32", "int32"])
        assert restored_data_problem(path) is not None, value


def test_a_normaliser_beyond_float32_gives_one_line(tmp_path):
    """A checkpoint whose ``norm_scale`` is 1e308: ``compress`` refused it with rc 2, but numpy's "overflow
    encountered in cast" RuntimeWarning came first (three lines on stderr)."""
    from baler_fuzz import checkpoint_cases, make_honest

    honest = make_honest(tmp_path / "honest")
    name = "ckpt: baler section norm_scale = [1e+308, 1e+308, 1e+308, 1e+30"
    case = checkpoint_cases(honest.ckpt, tmp_path / "ckpt", n_random=0)[name]
    results, verdicts, _ = run_all({f"{name} [compress]": case}, honest, tmp_path / "run")
    assert verdicts[f"{name} [compress]"] in GOOD, results[f"{name} [compress]"]["stderr"]
