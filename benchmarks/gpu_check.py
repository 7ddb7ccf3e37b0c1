"""One command for a GPU machine with no network: ``make gpu-check`` (issue 26, "On a GPU").

Three commands in one script:

``wheels --out DIR`` (here, with the package registries at hand; ``make gpu-wheels``)
    Wheels of everything the GPU run needs that the device image lacks: this project's own wheel and the
    closure of ``pyproject.toml``'s dependencies, resolved by pip for the image's Python (3.12, manylinux
    x86-64) with ``constraints.txt`` and this venv's versions as constraints, less what the image already
    has (:data:`IMAGE_PROVIDES`: torch, Lightning, numpy, scipy, ...; only metadata of those is fetched, never
    a CUDA torch wheel). ``nvidia-ml-py`` is carried all the same (:data:`ALWAYS_CARRY`): the version our
    sensor and fakes are checked against. The folder is emptied first (two versions of one package stop
    the install) and must stay under ``--max-mib`` (the device's working tree travels in 64 MiB).

``run`` (the default; on the GPU machine, after ``pip install --no-index --no-deps --target``; ``make gpu-check``)
    The parts below, in order, each in its own process with its own timeout, all within ``--budget-s``
    (a part that fails or times out is recorded and the next one runs; one the budget cannot fit any more
    is skipped): the environment (imports and versions), the GPU tests (``pytest -m gpu``),
    ``benchmarks/gpu_truth.py`` (per-step and per-epoch truth on the card), ``benchmarks/nvml_semantics.py``
    and ``benchmarks/overhead.py`` (3 ms CPU steps beside the card). Results go to ``--results-dir``
    (default ``benchmarks/results``), named after the card (``gpu_truth_h200.json``, ...), each with the card
    and driver in it; ``gpu_check.json`` holds the summary table printed at the end. With ``--copy-to DIR``
    (``$OUT`` on the device machine) the JSON files and one archive of the logs are copied there (at most
    eight files: what the device tool brings back).

    NVML is only read: the card's power limit, persistence mode and MIG mode are printed before the first
    part and after the last, and the summary says whether anything changed. Nothing here sets a clock, a
    limit, persistence or MIG.

``run --dry-run`` (here; ``make gpu-check-dry``)
    The same orchestration on this CPU machine: the fake NVML (``tests/fakes_nvml.py``) installed as
    ``pynvml``, a CPU workload in place of CUDA (``gpu_truth.py --dry-run``), the GPU tests collected and
    skipped, ``nvml_semantics.py`` saying it has no GPU, ``overhead.py`` in a short run. Results go to
    ``benchmarks/results/dry/`` (git-ignored), so a rehearsal never overwrites a card's results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
for _path in (BENCHMARKS, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from machine import machine_info, write_json_atomic  # noqa: E402
from nvml_semantics import _maybe, _text  # noqa: E402

RESULTS = BENCHMARKS / "results"
DRY_RESULTS = RESULTS / "dry"
BUDGET_S = 450.0  # the parts together; `make gpu-check` adds the install (seconds) for 8 minutes in all
MIN_PART_S = 20.0  # a part is not started with less time than this left in the budget
COPY_LIMIT = 8  # files the device tool brings back from $OUT
DEVICE_PYTHON = "3.12"  # python3 of the device image ('cuda'; /work/.library/device/KINDS.md, 2026-11)
WHEELS_MAX_MIB = 40.0

# Python packages of the device image ('cuda'), as KINDS.md listed them on 2026-11-17 (normalised names).
IMAGE_PROVIDES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn
scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
xarray xxhash yarl zipp
""".split())
ALWAYS_CARRY = frozenset({"nvidia-ml-py"})  # the pynvml our sensor and tests/fakes_nvml.py are checked against
PROJECT = "lightning-energy"

# Modules whose versions and origins the environment part records (a missing one fails that part).
ENVIRONMENT_MODULES = ("lightning_energy", "torch", "lightning", "pynvml", "zeus", "codecarbon", "jsonargparse",
                       "uproot", "awkward", "pytest")


def normalise(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


# ------------------------------------------------------------------------------------------ the card, read-only
def fake_pynvml(power_W: float = 130.0):
    """The fake NVML of ``tests/fakes_nvml.py`` on the real clock: one H200-like card (the measured H200
    semantics), with a driver version so that the card's description reads as a real one's."""
    from fakes_nvml import FakeGpu, FakeNvml

    fake = FakeNvml([FakeGpu(uuid="GPU-f0000000-1111-2222-3333-444444444444", name="NVIDIA H200 (fake)",
                             power_W=power_W)], clock=time.perf_counter, sleep=time.sleep)
    fake.nvmlSystemGetDriverVersion = lambda: "fake"
    fake._nvmlGetFunctionPointer = lambda name: None  # what Zeus checks to tell nvidia-ml-py from other pynvml
    return fake


def card_state(nvml, handle) -> dict[str, Any]:
    """Name, driver and the settings a careless run could change, through read queries only (W, MHz)."""
    persistence = _maybe(lambda: nvml.nvmlDeviceGetPersistenceMode(handle))
    return {
        "gpu": _text(nvml.nvmlDeviceGetName(handle)),
        "uuid": _maybe(lambda: _text(nvml.nvmlDeviceGetUUID(handle))),
        "driver": _maybe(lambda: _text(nvml.nvmlSystemGetDriverVersion())),
        "architecture": _maybe(lambda: nvml.nvmlDeviceGetArchitecture(handle)),
        "power_limit_W": _maybe(lambda: nvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000),
        "default_limit_W": _maybe(lambda: nvml.nvmlDeviceGetPowerManagementDefaultLimit(handle) / 1000),
        "limit_constraints_W": _maybe(lambda: [v / 1000 for v in
                                               nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)]),
        "persistence_mode": {0: "Disabled", 1: "Enabled"}.get(persistence, persistence),
        "mig_mode": _maybe(lambda: list(nvml.nvmlDeviceGetMigMode(handle))),
    }


def read_card(dry_run: bool, nvml_index: int = 0) -> dict[str, Any]:
    """:func:`card_state` of NVML GPU ``nvml_index`` (the fake one in a dry run); ``{"error": ...}`` if NVML
    cannot be read at all."""
    try:
        if dry_run:
            nvml = fake_pynvml()
        else:
            import pynvml as nvml
        nvml.nvmlInit()
        try:
            return card_state(nvml, nvml.nvmlDeviceGetHandleByIndex(nvml_index))
        finally:
            nvml.nvmlShutdown()
    except Exception as err:  # noqa: BLE001 - no card (or no pynvml) is recorded, and the parts still run
        return {"error": f"{type(err).__name__}: {err}"}


SETTINGS = ("power_limit_W", "persistence_mode", "mig_mode")  # what this check must leave as it found it


def settings_line(state: dict[str, Any]) -> str:
    if "error" in state:
        return f"NVML unreadable ({state['error']})"
    return (f"{state['gpu']}, driver {state['driver']}: power limit {state['power_limit_W']} W, "
            f"persistence {state['persistence_mode']}, MIG {state['mig_mode']}")


def card_slug(state: dict[str, Any]) -> str:
    """A file-name tag for the card: ``NVIDIA H200`` -> ``h200``, ``NVIDIA H100 80GB HBM3`` -> ``h100-80gb-hbm3``."""
    name = str(state.get("gpu", "unknown-gpu"))
    name = re.sub(r"^nvidia\s+", "", name, flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


# ------------------------------------------------------------------------------------------ the parts
@dataclass
class Part:
    """One step of the check: ``argv`` run from the repository root, at most ``timeout_s``; ``result`` is the
    JSON it writes (None: none); ``headline`` draws one line from that JSON for the summary."""

    name: str
    argv: list[str]
    timeout_s: float
    result: Path | None = None
    headline: Callable[[dict], str] | None = None
    after: Callable[[Part, dict], None] | None = None  # turns raw output into ``result`` (the GPU tests)


@dataclass
class Outcome:
    name: str
    status: str  # passed | failed | timed out | skipped | error
    returncode: int | None
    wall_s: float
    timeout_s: float
    result: str | None
    headline: str
    log: str | None


def run_part(part: Part, timeout_s: float, log_dir: Path, echo: bool = True) -> Outcome:
    """Run ``part`` in its own process group for at most ``timeout_s``, its output echoed and kept in
    ``log_dir/<name>.log``; a time-out kills the whole group (a benchmark's own children too)."""
    log_path = log_dir / f"{part.name}.log"
    started = time.monotonic()
    print(f"\n=== {part.name} (timeout {timeout_s:.0f} s): {' '.join(part.argv)}", flush=True)
    try:
        process = subprocess.Popen(part.argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except OSError as err:
        return Outcome(part.name, "error", None, 0.0, timeout_s, None, f"{type(err).__name__}: {err}", None)
    with open(log_path, "wb") as log:
        def copy_output() -> None:
            for line in iter(process.stdout.readline, b""):
                log.write(line)
                if echo:
                    sys.stdout.write(line.decode(errors="replace"))
                    sys.stdout.flush()

        reader = threading.Thread(target=copy_output, daemon=True)
        reader.start()
        timed_out = False
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        reader.join(timeout=5.0)
        process.stdout.close()
    wall_s = time.monotonic() - started
    status = "timed out" if timed_out else ("passed" if process.returncode == 0 else "failed")
    if part.after is not None:
        try:
            part.after(part, {"status": status, "log": log_path})
        except Exception as err:  # noqa: BLE001 - a part's results that cannot be read are a finding
            print(f"{part.name}: could not collect its results: {type(err).__name__}: {err}")
    result = part.result if part.result is not None and part.result.is_file() else None
    headline = ""
    if result is not None and part.headline is not None:
        try:
            headline = part.headline(json.loads(result.read_text()))
        except Exception as err:  # noqa: BLE001
            headline = f"(result unreadable: {type(err).__name__}: {err})"
    if result is None and part.result is not None:
        headline = f"wrote no {part.result.name}"
    if timed_out:
        headline = f"killed after {timeout_s:.0f} s" + (f"; {headline}" if headline else "")
    return Outcome(part.name, status, None if timed_out else process.returncode, wall_s, timeout_s,
                   None if result is None else str(result), headline, str(log_path))


def run_parts(parts: list[Part], budget_s: float, log_dir: Path, clock: Callable[[], float] = time.monotonic,
              min_part_s: float = MIN_PART_S, echo: bool = True) -> list[Outcome]:
    """Each part in turn with ``min(its timeout, what is left of budget_s)``; once less than ``min_part_s``
    is left, the remaining parts are skipped (recorded as such). A part's failure never stops the next."""
    deadline = clock() + budget_s
    outcomes = []
    for part in parts:
        left = deadline - clock()
        if left < min_part_s:
            outcomes.append(Outcome(part.name, "skipped", None, 0.0, part.timeout_s, None,
                                    f"{max(left, 0):.0f} s of the budget left", None))
            continue
        outcomes.append(run_part(part, min(part.timeout_s, left), log_dir, echo=echo))
    return outcomes


def stamp_card(path: Path, card: dict[str, Any]) -> None:
    """Name the card and driver in a part's JSON that does not (``overhead.py`` knows only the CPU)."""
    if not path.is_file():
        return
    data = json.loads(path.read_text())
    if isinstance(data, dict) and "card" not in data:
        data["card"] = card
        write_json_atomic(path, data)


# --- the GPU tests: pytest's JUnit XML as JSON, with the figures the tests print -------------------------------
def gpu_test_files() -> list[str]:
    """Test files holding ``gpu``-marked tests: only these are collected (a module of the CPU suite may import
    what the device image lacks, and one collection error would stop every test)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text())


def junit_to_json(xml_path: Path, out: Path, card: dict[str, Any], status: str) -> None:
    """Every test's outcome, time and printed lines (``junit_logging=system-out``) from pytest's JUnit XML."""
    tests = []
    if xml_path.is_file():
        for case in ElementTree.parse(xml_path).getroot().iter("testcase"):
            outcome = "passed"
            message = None
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    message = (node.get("message") or "")[:2000]
                    break
            printed = case.findtext("system-out") or ""
            tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                          "time_s": float(case.get("time") or 0.0), "message": message,
                          "printed": printed.strip().splitlines()[-40:]})
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    write_json_atomic(out, {"benchmark": "gpu_tests", "date": now_iso(), "card": card,
                            "machine": machine_info(), "pytest_status": status, "counts": counts,
                            "tests": tests})


def gpu_tests_headline(data: dict) -> str:
    counts = data.get("counts") or {}
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no tests ran"


def truth_headline(data: dict) -> str:
    goals = data.get("goals") or {}
    parts = []
    for key, label in (("epoch_vs_nvml_pct", "epochs vs NVML"), ("epoch_vs_zeus_pct", "vs Zeus"),
                       ("step_median_pct", "steps median"), ("step_p95_pct", "p95")):
        goal = goals.get(key)
        if goal and goal.get("measured") is not None:
            parts.append(f"{label} {goal['measured']:.2f} % ({'met' if goal['met'] else 'NOT met'}, "
                         f"<= {goal['goal_max']:g})")
    return "; ".join(parts) or "no figures"


def semantics_headline(data: dict) -> str:
    polled = (data.get("polled") or {}).get("busy") or {}
    counter = polled.get("counter_interval_ms") or {}
    window = data.get("instant_window_alone") or {}
    line = []
    if counter:
        line.append(f"counter every {counter['median']:.1f} ms")
    if window.get("lag_ms") is not None:
        line.append(f"instant = mean of {window['length_ms']} ms ending {window['lag_ms']} ms before refresh "
                    f"(R² {window['r2']:.2f})")
    if data.get("idle_W") is not None:
        line.append(f"idle {data['idle_W']:.0f} W, busy {data['busy_W']:.0f} W")
    return "; ".join(line) or "no GPU: nothing measured"


def overhead_headline(data: dict) -> str:
    goals = data.get("goals") or {}
    ratio = goals.get("step_time_ratio") or {}
    plain = ((data.get("summary") or {}).get("plain") or {}).get("median_step_ms")
    if not ratio:
        return ""
    return (f"energy / plain {ratio['measured']:.4f} x at {plain:.2f} ms steps "
            f"({'met' if ratio['met'] else 'NOT met'}, <= {ratio['goal_max']:g})")


def environment_headline(data: dict) -> str:
    missing = [m for m, v in (data.get("modules") or {}).items() if "error" in v]
    versions = {m: v.get("version") for m, v in (data.get("modules") or {}).items() if "error" not in v}
    return (f"missing: {', '.join(missing)}; " if missing else "") + ", ".join(
        f"{m} {v}" for m, v in versions.items() if m in ("torch", "lightning", "zeus", "pynvml"))


def plan(python: str, results: Path, slug: str, dry_run: bool, scratch_dir: Path, card: dict) -> list[Part]:
    """The parts of the check in the order they run (issue 26: the GPU tests, the real-card truth, NVML's
    semantics, the overhead at 3 ms steps)."""
    dry = ["--dry-run"] if dry_run else []
    junit = scratch_dir / "gpu_tests.xml"
    tests_json = results / f"gpu_tests_{slug}.json"

    def collect_tests(part: Part, run: dict) -> None:
        junit_to_json(junit, tests_json, card, run["status"])

    overhead_args = (["--reps", "1", "--steps", "60", "--epochs", "40", "--epoch-reps", "1", "--profile", "never"]
                     if dry_run else ["--reps", "3", "--steps", "300", "--epochs", "200", "--epoch-reps", "1"])
    return [
        Part("environment", [python, str(BENCHMARKS / "gpu_check.py"), "environment",
                             "--out", str(results / f"gpu_environment_{slug}.json")], 60,
             results / f"gpu_environment_{slug}.json", environment_headline),
        Part("gpu-tests", [python, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           f"--junitxml={junit}", "-o", "junit_logging=system-out", "-o",
                           "junit_family=xunit1", *gpu_test_files()], 200,
             tests_json, gpu_tests_headline, after=collect_tests),
        Part("gpu-truth", [python, str(BENCHMARKS / "gpu_truth.py"), *dry,
                           "--out", str(results / f"gpu_truth_{slug}.json")], 150,
             results / f"gpu_truth_{slug}.json", truth_headline),
        Part("nvml-semantics", [python, str(BENCHMARKS / "nvml_semantics.py"),
                                "--out", str(results / f"nvml_semantics_{slug}.json")], 110,
             results / f"nvml_semantics_{slug}.json", semantics_headline),
        Part("overhead", [python, str(BENCHMARKS / "overhead.py"), *overhead_args,
                          "--out", str(results / f"overhead_gpu_{slug}.json")], 120,
             results / f"overhead_gpu_{slug}.json", overhead_headline),
        # issue 31: the original Baler's samples/s and ours on the same card (batch 512, float32 and bf16); the
        # original's checkout travels as .baler-original (carry it), else its side is an error entry
        Part("baler-gpu", [python, str(BENCHMARKS / "baler_gpu.py"), *dry,
                           "--baler-original", str(ROOT / ".baler-original"), *(["--quick"] if dry_run else []),
                           "--out", str(results / f"baler_gpu_{slug}.json")], 150,
             results / f"baler_gpu_{slug}.json", lambda d: str(d.get("goals"))),
    ]


def format_summary(outcomes: list[Outcome]) -> str:
    head = f"{'part':<15} {'status':<10} {'wall s':>7} {'limit s':>7}  headline"
    rows = [head, "-" * 100]
    for o in outcomes:
        rows.append(f"{o.name:<15} {o.status:<10} {o.wall_s:>7.1f} {o.timeout_s:>7.0f}  {o.headline}")
    return "\n".join(rows)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def copy_results(paths: list[Path], log_dir: Path, dest: Path) -> list[str]:
    """The JSON files and one archive of the logs into ``dest`` (the device tool brings back 8 files)."""
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in paths[:COPY_LIMIT - 1]:
        if path.is_file():
            shutil.copy2(path, dest / path.name)
            copied.append(path.name)
    archive = dest / "gpu_check_logs.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(log_dir, arcname="gpu_check_logs")
    copied.append(archive.name)
    return copied


def check(args: argparse.Namespace) -> int:
    """``run``: the parts within the budget, the card's settings before and after, the summary."""
    results = args.results_dir or (DRY_RESULTS if args.dry_run else RESULTS)
    results.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    before = read_card(args.dry_run)
    print(f"gpu-check{' (dry run: fake NVML, CPU workload)' if args.dry_run else ''}: before: "
          f"{settings_line(before)}", flush=True)
    slug = card_slug(before) if "error" not in before else "no-gpu"
    card = {k: v for k, v in before.items() if k not in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        log_dir = Path(scratch) / "logs"
        log_dir.mkdir()
        parts = plan(args.python, results, slug, args.dry_run, Path(scratch), card)
        if args.only:
            parts = [p for p in parts if p.name in args.only]
        outcomes = run_parts(parts, args.budget_s, log_dir)
        for part in parts:
            if part.result is not None:
                stamp_card(part.result, card)
        after = read_card(args.dry_run)
        changed = [k for k in SETTINGS if before.get(k) != after.get(k)]
        summary = {
            "benchmark": "gpu_check", "date": now_iso(), "dry_run": args.dry_run, "card": card,
            "machine": machine_info(), "budget_s": args.budget_s, "wall_s": time.monotonic() - started,
            "settings_before": {k: before.get(k) for k in SETTINGS},
            "settings_after": {k: after.get(k) for k in SETTINGS}, "settings_changed": changed,
            "parts": [o.__dict__ for o in outcomes],
        }
        summary_path = results / "gpu_check.json"
        write_json_atomic(summary_path, summary)
        print(f"\ngpu-check: after: {settings_line(after)}")
        print("gpu-check: the card's power limit, persistence and MIG mode are "
              + (f"CHANGED: {changed}" if changed else "as they were before"))
        print(f"\n{format_summary(outcomes)}")
        print(f"\nwrote {summary_path} and the parts' results in {results} "
              f"({summary['wall_s']:.0f} s of a {args.budget_s:.0f} s budget)")
        if args.copy_to:
            files = [summary_path, *[p.result for p in parts if p.result is not None]]
            copied = copy_results(files, log_dir, Path(args.copy_to))
            print(f"copied to {args.copy_to}: {', '.join(copied)}")
    return 0 if all(o.status == "passed" for o in outcomes) and not changed else 1


# ------------------------------------------------------------------------------------------ environment
def environment(out: Path) -> int:
    """Which module each import finds (file, version): the carried wheels, the image's packages and this
    checkout (first on ``PYTHONPATH``) seen together. A module that fails to import fails the part."""
    import importlib

    modules = {}
    for name in ENVIRONMENT_MODULES:
        try:
            module = importlib.import_module(name)
            version = getattr(module, "__version__", None)
            if version is None and name == "pynvml":
                from importlib.metadata import version as dist_version
                version = dist_version("nvidia-ml-py")
            modules[name] = {"version": str(version), "file": getattr(module, "__file__", None)}
        except Exception as err:  # noqa: BLE001 - recorded: what is missing is the finding
            modules[name] = {"error": f"{type(err).__name__}: {err}"}
        print(f"  {name:18s} {modules[name]}")
    cuda = {}
    with contextlib.suppress(Exception):
        import torch

        cuda = {"available": torch.cuda.is_available(), "version": torch.version.cuda,
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    write_json_atomic(out, {"benchmark": "gpu_environment", "date": now_iso(), "machine": machine_info(),
                            "python": sys.executable, "pythonpath": os.environ.get("PYTHONPATH", ""),
                            "cuda": cuda, "modules": modules})
    return 1 if any("error" in v for v in modules.values()) else 0


# ------------------------------------------------------------------------------------------ wheels
def platform_args(python_version: str) -> list[str]:
    """pip's options for the device: CPython ``python_version`` on manylinux x86-64 up to glibc 2.39 (the image's);
    pip matches each manylinux tag exactly, so every one is named."""
    tag = "cp" + python_version.replace(".", "")
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp", "--abi", tag]
    for platform in ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
                     *[f"manylinux_2_{n}_x86_64" for n in range(17, 40)]]:
        args += ["--platform", platform]
    return args


def project_dependencies(pyproject: Path) -> list[str]:
    import tomllib

    return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])


def requirement_name(requirement: str) -> str:
    return normalise(re.split(r"[\s\[<>=!~;@]", requirement.strip(), maxsplit=1)[0])


def carried(name: str) -> bool:
    """Whether a distribution travels as a wheel: the image lacks it, or it is one we always carry."""
    return normalise(name) in ALWAYS_CARRY or normalise(name) not in IMAGE_PROVIDES


def venv_constraints(path: Path) -> None:
    """This venv's versions as pip constraints (editable and local versions left out): the device gets
    the versions the CPU suite ran with."""
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], check=True,
                            capture_output=True, text=True).stdout.splitlines()
    path.write_text("\n".join(line for line in frozen
                              if "==" in line and "+" not in line and " @ " not in line) + "\n")


def resolve(requirements: list[str], python_version: str, constraints: list[Path]) -> list[tuple[str, str]]:
    """(name, version) of every distribution pip would install for ``requirements`` on the device, resolved
    from metadata alone (``--dry-run --report``: no wheel of a package left behind is downloaded)."""
    with tempfile.TemporaryDirectory(prefix="gpu_wheels_") as tmp:
        report = Path(tmp) / "report.json"
        argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                "--report", str(report), "--target", str(Path(tmp) / "target"), *platform_args(python_version)]
        for c in constraints:
            argv += ["-c", str(c)]
        subprocess.run([*argv, *requirements], check=True)
        installs = json.loads(report.read_text())["install"]
    return sorted((normalise(i["metadata"]["name"]), i["metadata"]["version"]) for i in installs)


def build_wheels(out: Path, python_version: str, max_mib: float) -> int:
    """``make gpu-wheels``: this project's wheel and the wheels of what the device image lacks, in ``out``."""
    requirements = [r for r in project_dependencies(ROOT / "pyproject.toml") if carried(requirement_name(r))]
    print(f"gpu-wheels for Python {python_version}: resolving {', '.join(requirements)} "
          f"(the image has the rest)", flush=True)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="gpu_wheels_") as tmp:
        frozen = Path(tmp) / "venv-constraints.txt"
        venv_constraints(frozen)
        pins = resolve(requirements, python_version, [ROOT / "constraints.txt", frozen])
    wanted = [(n, v) for n, v in pins if carried(n)]
    left = sorted(n for n, _ in pins if not carried(n))
    print(f"  the image has: {', '.join(left)}")
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(out),
                    *platform_args(python_version), *[f"{n}=={v}" for n, v in wanted]], check=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(ROOT)],
                   check=True)
    wheels = sorted(out.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"  {w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
    print(f"  {total / 2**20:7.2f} MiB in {len(wheels)} wheels ({out}; limit {max_mib:g} MiB)")
    names = [normalise(w.name.split("-")[0]) for w in wheels]
    doubles = sorted({n for n in names if names.count(n) > 1})
    if doubles:
        print(f"gpu-wheels: two versions of {', '.join(doubles)}: the install would stop")
        return 1
    if total > max_mib * 2**20:
        print(f"gpu-wheels: {total / 2**20:.1f} MiB is over the {max_mib:g} MiB limit")
        return 1
    return 0


# ------------------------------------------------------------------------------------------ command line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", default="run", choices=("run", "wheels", "environment"))
    parser.add_argument("--dry-run", action="store_true", help="run: the fake NVML and a CPU workload")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help=f"run: all parts (default {BUDGET_S:g})")
    parser.add_argument("--results-dir", type=Path, help="run: default benchmarks/results (dry: .../results/dry)")
    parser.add_argument("--copy-to", help="run: copy the JSON results and the logs here ($OUT on the device)")
    parser.add_argument("--only", nargs="+", help="run: only these parts")
    parser.add_argument("--python", default=sys.executable, help="run: the interpreter of the parts")
    parser.add_argument("--out", type=Path, help="wheels: the folder; environment: the JSON file")
    parser.add_argument("--python-version", default=DEVICE_PYTHON, help=f"wheels: default {DEVICE_PYTHON}")
    parser.add_argument("--max-mib", type=float, default=WHEELS_MAX_MIB, help="wheels: size limit")
    args = parser.parse_args(argv)
    if args.command == "wheels":
        if args.out is None:
            parser.error("wheels needs --out DIR")
        return build_wheels(args.out, args.python_version, args.max_mib)
    if args.command == "environment":
        if args.out is None:
            parser.error("environment needs --out FILE")
        return environment(args.out)
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
