"""Installed size and package count of lightning-energy's core and of each extra, on top of torch.

What a user's ``pip install lightning-energy[EXTRA]`` adds to an environment that already has torch:

1. one venv under ``--work`` gets ``torch`` from ``constraints.txt`` (the CPU build here; pip's cache);
2. the project is built into a wheel from a copy of its sources (this checkout is not written to);
3. for each target (``core`` and each extra of ``pyproject.toml``; ``--before REF`` adds that commit's plain
   ``pip install``), a fresh venv sees the torch venv's packages through a ``.pth`` file, so pip counts torch
   and its dependencies as installed, and ``pip install -c constraints.txt WHEEL[EXTRA]`` puts everything
   else into the new venv's own ``site-packages``: its growth is what the target adds.

Quoted per target: MiB added (files' sizes, 2^20 bytes) and distributions added (``*.dist-info``, the project
itself not counted). It downloads what pip's cache lacks from the registries: each target is installed once.

Run: ``.venv/bin/python benchmarks/install_size.py [--targets core,carbon] [--before HEAD]``.
Writes ``benchmarks/results/install_size.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported: benchmarks/machine.py
import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "install_size.json"
CONSTRAINTS = ROOT / "constraints.txt"
SOURCES = ("pyproject.toml", "README.md", "lightning_energy", "baler_lit")
MIB = 2**20
DISTRIBUTION = "lightning_energy"  # the project's own dist-info, not counted


def run(command: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], check=True, capture_output=True, text=True, **kwargs)


def site_packages(venv: Path) -> Path:
    relative = Path(sysconfig.get_path("purelib")).relative_to(sysconfig.get_path("data"))
    return venv / relative


def footprint(folder: Path) -> tuple[int, set[str]]:
    """(bytes of every file under ``folder``, names of its distributions)."""
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
    dists = {p.name.split("-")[0].lower() for p in folder.glob("*.dist-info")}
    return size, dists


def build_wheel(source: Path, out: Path) -> Path:
    """The project's wheel, built from a copy of ``source``'s files (``source`` itself is not written to)."""
    copy = out / "src"
    for name in SOURCES:
        origin = source / name
        if origin.is_dir():
            shutil.copytree(origin, copy / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif origin.exists():
            copy.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, copy / name)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out / "wheel", copy])
    (wheel,) = (out / "wheel").glob("*.whl")
    return wheel


def torch_venv(work: Path) -> Path:
    venv = work / "torch"
    run([sys.executable, "-m", "venv", venv])
    run([venv / "bin" / "python", "-m", "pip", "install", "-q", "-c", CONSTRAINTS, "torch"])
    return venv


def measure(name: str, requirement: str, base: Path, work: Path) -> dict:
    """What ``pip install requirement`` adds to a venv that sees ``base``'s packages."""
    venv = work / name
    run([sys.executable, "-m", "venv", venv])
    own = site_packages(venv)
    (own / "zz_torch_base.pth").write_text(f"{site_packages(base)}\n")  # after the venv's own entries
    before_bytes, before_dists = footprint(own)
    started = time.monotonic()
    run([venv / "bin" / "python", "-m", "pip", "install", "-q", "-c", CONSTRAINTS, requirement])
    seconds = time.monotonic() - started
    after_bytes, after_dists = footprint(own)
    added = sorted(after_dists - before_dists - {DISTRIBUTION, DISTRIBUTION.replace("_", "-")})
    shutil.rmtree(venv)  # a few GB in all otherwise
    return {"target": name, "requirement": requirement.split("/")[-1], "MiB": round((after_bytes - before_bytes) / MIB, 1),
            "packages": len(added), "added": added, "install_s": round(seconds, 1)}


def extras_of(pyproject: Path) -> list[str]:
    extras = tomllib.loads(pyproject.read_text())["project"].get("optional-dependencies", {})
    return [name for name in extras if name != "dev"]


def old_source(ref: str, work: Path) -> Path:
    """The checkout's files at commit ``ref`` (``git archive``: nothing in the checkout changes)."""
    folder = work / f"source-{ref}"
    folder.mkdir()
    archive = subprocess.run(["git", "-C", ROOT, "archive", ref, *SOURCES], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    return folder


def table(rows: list[dict]) -> str:
    lines = [f"{'target':<22} {'MiB':>7} {'packages':>8}", "-" * 39]
    lines += [f"{r['target']:<22} {r['MiB']:>7.1f} {r['packages']:>8}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=None,
                        help="comma-separated: core and extras of pyproject.toml (default: core and every extra)")
    parser.add_argument("--before", default=None, metavar="REF",
                        help="also measure the plain install of this commit (e.g. HEAD before the extras)")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a new one under /tmp)")
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--update", action="store_true",
                        help="keep --out's other rows: replace only the targets measured now (one extra changed)")
    args = parser.parse_args(argv)
    targets = args.targets.split(",") if args.targets else ["core", *extras_of(ROOT / "pyproject.toml")]
    work = args.work or Path(tempfile.mkdtemp(prefix="install-size-"))
    started = time.monotonic()
    base = torch_venv(work)
    torch_bytes, torch_dists = footprint(site_packages(base))
    wheel = build_wheel(ROOT, work / "build")
    rows = []
    if args.before:
        old_wheel = build_wheel(old_source(args.before, work), work / "build-before")
        rows.append(measure(f"before ({args.before})", str(old_wheel), base, work))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    for target in targets:
        requirement = str(wheel) if target == "core" else f"{DISTRIBUTION.replace('_', '-')}[{target}] @ {wheel.as_uri()}"
        rows.append(measure(target, requirement, base, work))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    if args.update and args.out.exists():
        measured = {r["target"] for r in rows}
        rows = [r for r in json.loads(args.out.read_text())["rows"] if r["target"] not in measured] + rows
    print()
    print(f"on top of torch ({round(torch_bytes / MIB)} MiB, {len(torch_dists)} packages with pip and setuptools):")
    print(table(rows))
    machine.write_json_atomic(args.out, {
        "what": "MiB and distributions that `pip install -c constraints.txt` adds on top of torch, per target",
        "torch_venv": {"MiB": round(torch_bytes / MIB, 1), "packages": sorted(torch_dists)},
        "rows": rows, "wall_s": round(time.monotonic() - started, 1), "python": sys.version.split()[0],
        "machine": machine.machine_info(),
    })
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
