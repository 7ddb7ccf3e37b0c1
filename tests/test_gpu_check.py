"""``make gpu-check``'s orchestration and the GPU truth's analysis, rehearsed on this CPU machine.

No timing is asserted: the parts are tiny commands whose outcome does not depend on how fast they run (one
sleeps far longer than its limit), and the truth's analysis runs on made-up counter readings.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_check  # noqa: E402
import gpu_truth  # noqa: E402


def part(name: str, code: str, timeout_s: float = 60.0, result: Path | None = None, headline=None):
    return gpu_check.Part(name, [sys.executable, "-c", code], timeout_s, result, headline)


def test_a_failing_or_hanging_part_is_recorded_and_the_next_part_still_runs(tmp_path):
    result = tmp_path / "r.json"
    parts = [
        part("fails", "import sys; print('about to fail'); sys.exit(3)"),
        part("hangs", "import time; time.sleep(600)", timeout_s=1.0),
        part("writes", f"import json; json.dump({{'answer': 42}}, open({str(result)!r}, 'w'))", result=result,
             headline=lambda data: f"answer {data['answer']}"),
    ]
    outcomes = gpu_check.run_parts(parts, budget_s=1000.0, log_dir=tmp_path, min_part_s=0.0, echo=False)
    assert [o.status for o in outcomes] == ["failed", "timed out", "passed"]
    assert outcomes[0].returncode == 3 and "about to fail" in Path(outcomes[0].log).read_text()
    assert outcomes[1].returncode is None and outcomes[1].headline.startswith("killed after 1 s")
    assert outcomes[2].headline == "answer 42" and outcomes[2].result == str(result)
    table = gpu_check.format_summary(outcomes)
    assert all(name in table for name in ("fails", "hangs", "writes", "timed out"))


def test_parts_the_budget_cannot_fit_any_more_are_skipped_not_started(tmp_path):
    now = iter([0.0, 0.0, 95.0, 95.0]).__next__  # the budget's start, then before each part
    marker = tmp_path / "started"
    parts = [part("first", "pass"), part("second", f"open({str(marker)!r}, 'w')")]
    outcomes = gpu_check.run_parts(parts, budget_s=100.0, log_dir=tmp_path, clock=now, min_part_s=20.0, echo=False)
    assert [o.status for o in outcomes] == ["passed", "skipped"]
    assert not marker.exists() and "5 s of the budget left" in outcomes[1].headline


def test_each_part_gets_at_most_what_is_left_of_the_budget(tmp_path, monkeypatch):
    limits = []
    monkeypatch.setattr(gpu_check, "run_part", lambda p, timeout_s, log_dir, echo: limits.append(timeout_s))
    now = iter([0.0, 10.0, 70.0]).__next__
    gpu_check.run_parts([part("a", "pass", timeout_s=200.0), part("b", "pass", timeout_s=20.0)], budget_s=100.0,
                        log_dir=tmp_path, clock=now, min_part_s=5.0)
    assert limits == [90.0, 20.0]


def test_the_plan_names_every_result_after_the_card_and_collects_only_gpu_test_files(tmp_path):
    card = gpu_check.read_card(dry_run=True)
    slug = gpu_check.card_slug(card)
    assert slug == "h200-fake" and card["driver"] == "fake" and card["power_limit_W"] == 700.0
    assert gpu_check.card_slug({"gpu": "NVIDIA H100 80GB HBM3"}) == "h100-80gb-hbm3"
    parts = gpu_check.plan("python3", tmp_path, slug, True, tmp_path, card)
    assert [p.name for p in parts] == ["environment", "gpu-tests", "gpu-truth", "nvml-semantics", "overhead", "baler-gpu"]
    assert all(p.result.name.endswith(f"_{slug}.json") for p in parts)
    assert all("--dry-run" in p.argv for p in parts if p.name == "gpu-truth")
    test_files = gpu_check.gpu_test_files()
    assert "tests/test_gpu.py" in test_files and "tests/test_gpu_check.py" not in test_files
    assert sum(p.timeout_s for p in parts) >= gpu_check.BUDGET_S  # the budget, not the sum, is the limit


def test_junit_results_become_json_with_the_card_and_what_each_test_printed(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text("""<testsuites><testsuite>
      <testcase classname="tests.test_gpu" name="test_a" time="1.5">
        <system-out>epoch 1: ours 10 J</system-out></testcase>
      <testcase classname="tests.test_gpu" name="test_b" time="0.1">
        <failure message="assert 1 == 2">x</failure></testcase>
      <testcase classname="tests.test_gpu" name="test_c" time="0"><skipped message="needs a CUDA GPU"/></testcase>
    </testsuite></testsuites>""")
    out = tmp_path / "gpu_tests.json"
    gpu_check.junit_to_json(xml, out, {"gpu": "X", "driver": "1"}, "failed")
    data = json.loads(out.read_text())
    assert data["counts"] == {"passed": 1, "failed": 1, "skipped": 1} and data["card"]["driver"] == "1"
    assert data["tests"][0]["printed"] == ["epoch 1: ours 10 J"]
    assert data["tests"][1]["message"] == "assert 1 == 2"
    assert gpu_check.gpu_tests_headline(data) == "1 failed, 1 passed, 1 skipped"


def test_a_result_without_the_card_is_stamped_with_it_and_one_with_it_is_left_alone(tmp_path):
    plain, named = tmp_path / "a.json", tmp_path / "b.json"
    plain.write_text(json.dumps({"benchmark": "overhead"}))
    named.write_text(json.dumps({"card": {"gpu": "mine"}}))
    for path in (plain, named, tmp_path / "missing.json"):
        gpu_check.stamp_card(path, {"gpu": "H200", "driver": "580"})
    assert json.loads(plain.read_text())["card"] == {"gpu": "H200", "driver": "580"}
    assert json.loads(named.read_text())["card"] == {"gpu": "mine"}


def test_results_copied_for_the_device_tool_stay_within_its_eight_files(tmp_path):
    files = []
    for i in range(10):
        files.append(tmp_path / f"r{i}.json")
        files[-1].write_text("{}")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "part.log").write_text("output")
    copied = gpu_check.copy_results(files, logs, tmp_path / "out")
    assert len(copied) == gpu_check.COPY_LIMIT and copied[-1] == "gpu_check_logs.tar.gz"
    assert len(list((tmp_path / "out").iterdir())) == gpu_check.COPY_LIMIT


def test_only_what_the_image_lacks_travels_as_wheels_and_nvidia_ml_py_always_does():
    assert not gpu_check.carried("torch") and not gpu_check.carried("Lightning")
    assert not gpu_check.carried("scikit_learn")  # names compared as pip does
    assert gpu_check.carried("zeus") and gpu_check.carried("codecarbon") and gpu_check.carried("nvidia-ml-py")
    assert gpu_check.requirement_name("jsonargparse[signatures]>=4.32") == "jsonargparse"
    assert gpu_check.requirement_name("typing-extensions>=4.4") == "typing-extensions"
    assert "--abi" in gpu_check.platform_args("3.12") and "cp312" in gpu_check.platform_args("3.12")


# ------------------------------------------------------------------------------------------ the truth's analysis
def counter_updates(power_of, start: float, end: float, period: float = 0.1):
    """What the reference poller records of a counter that updates every ``period`` with the exact energy up
    to the update; ``power_of(t)`` in W, integrated by 1 ms steps."""
    updates, energy_mJ, next_update = [], 0.0, start + period
    for ms in range(round((end - start) * 1000)):
        t = start + ms / 1000
        if t >= next_update:
            updates.append((next_update, int(energy_mJ)))
            next_update += period
        energy_mJ += power_of(t)  # 1 ms at power_of(t) W is power_of(t) mJ
    return updates


def test_the_counter_reference_interpolates_between_updates_and_bounds_itself():
    updates = [(1.0, 1000), (1.1, 2000), (1.2, 2500)]
    value, bound = gpu_truth.counter_energy_J(updates, 1.05)
    assert value == pytest.approx(1.5) and bound == pytest.approx(0.5)
    # each update holds the energy up to 50 ms before it: 1.10 s lies halfway between the 2nd and 3rd
    assert gpu_truth.counter_energy_J(updates, 1.10, lag_s=0.05)[0] == pytest.approx(2.25)
    assert gpu_truth.counter_energy_J(updates, 0.9) is None and gpu_truth.counter_energy_J(updates, 1.3) is None


def test_phase_powers_steps_and_epochs_are_read_against_the_counter(tmp_path):
    """Busy 600 W / idle 100 W in 1 s phases, then 100 ms steps; a callback that reads the truth exactly for
    every step but one (+10 %), and one epoch 2 % high: the analysis must find those and nothing else."""
    busy_long = [(11.0, 12.0), (13.0, 14.0)]
    long_phases = [("idle", 10.0, 11.0), ("busy", 11.0, 12.0), ("idle", 12.0, 13.0), ("busy", 13.0, 14.0)]
    edges = [20.0 + 0.1 * i for i in range(21)]
    short_busy = [(edges[i], edges[i + 1]) for i in range(2, 18, 2)]
    truth = gpu_truth.PowerModel(600.0, 100.0, "truth")

    def power(busy):
        return lambda t: 600.0 if any(a <= t < b for a, b in busy) else 100.0

    def fit(busy, steps, updates, epochs=()):
        return {"schedule": [(k, b - a) for k, a, b in steps], "observed_steps": [(a, b) for _, a, b in steps],
                "busy": busy, "updates": updates, "observed_epochs": list(epochs),
                "step_figures": [{"start_s": a, "end_s": b, "J": truth.energy_J(a, b, busy) * (1.1 if i == 7 else 1),
                                  "extrapolated": False} for i, (_, a, b) in enumerate(steps)],
                "epoch_figures": [{"epoch": 0, "start_s": 20.0, "end_s": 22.0, "bound_J": 1.0, "extrapolated": False,
                                   "J": 1.02 * truth.energy_J(20.0, 22.0, busy)}] if epochs else []}

    long_fit = fit(busy_long, long_phases, counter_updates(power(busy_long), 9.5, 14.5))
    short_steps = [("busy" if any(a == s for s, _ in short_busy) else "idle", a, b) for a, b in zip(edges, edges[1:])]
    true_epoch_J = truth.energy_J(20.0, 22.0, short_busy)
    short_fit = fit(short_busy, short_steps, counter_updates(power(short_busy), 19.5, 22.5, period=0.1037),
                    epochs=[{"epoch": 0, "start": 20.0, "end": 22.0, "zeus_J": true_epoch_J}])
    analysis = gpu_truth.analyse(long_fit, short_fit)
    steady = analysis["long_steps"]["steady"]
    assert steady["busy_W"] == pytest.approx(600.0, rel=0.01) and steady["idle_W"] == pytest.approx(100.0, rel=0.01)
    own = analysis["short_steps"]["fit"]
    assert own["busy_W"] == pytest.approx(600.0, rel=0.02) and own["idle_W"] == pytest.approx(100.0, rel=0.05)
    errors = [r["short_steps_fit_error_pct"] for r in analysis["short_steps"]["steps"]]
    assert max(range(len(errors)), key=lambda i: abs(errors[i])) == 7 and abs(errors[7]) > 5
    assert sorted(abs(e) for e in errors)[len(errors) // 2] < 2.0
    (epoch,) = analysis["epochs"]
    assert epoch["vs_nvml_pct"] == pytest.approx(2.0, abs=0.3) and epoch["vs_zeus_pct"] == pytest.approx(2.0)
    goals = gpu_truth.goals_of(analysis)
    assert goals["epoch_vs_nvml_pct"]["met"] is False and goals["epoch_vs_zeus_pct"]["met"] is True
    assert "vs NVML" in gpu_truth.format_tables(analysis, goals)
    assert gpu_check.truth_headline({"goals": goals}).startswith("epochs vs NVML 2.")


@pytest.mark.slow
def test_the_dry_run_of_the_truth_goes_through_two_real_fits_on_the_fake_card(tmp_path):
    """``gpu_truth.py --dry-run --quick`` (in its own process: it installs the fake as ``pynvml``, and Zeus
    caches the GPUs it finds): the fake NVML, Trainer fits with EnergyCallback and Zeus windows; the JSON
    names the card and holds every section (its figures mean nothing at these lengths)."""
    out = tmp_path / "truth.json"
    subprocess.run([sys.executable, str(BENCHMARKS / "gpu_truth.py"), "--dry-run", "--quick", "--out", str(out)],
                   check=True, capture_output=True, timeout=240)
    data = json.loads(out.read_text())
    assert data["dry_run"] is True and data["card"]["gpu"] == "NVIDIA H200 (fake)" and data["card"]["driver"] == "fake"
    assert {"goals", "long_steps", "short_steps", "epochs", "fits"} <= set(data)
    assert len(data["epochs"]) == 2 and data["fits"]["short_steps"]["gpu_sensor"] == "gpu0"
    assert data["fits"]["short_steps"]["zeus_error"] is None and data["epochs"][0]["zeus_J"] is not None
