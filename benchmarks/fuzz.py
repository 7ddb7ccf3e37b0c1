"""The fuzzer at scale (issue 29): thousands of hostile inputs over every ``baler-lit`` file command.

``tests/baler_fuzz.py`` builds the attacks, from seeds ``--seed``, ``--seed + 1``, ... until ``--n`` cases
are built: mutated ``.baler`` files (targeted and seeded random) given to ``decompress``, ``info`` and
``evaluate --compressed``; crafted checkpoints (model sizes that would allocate gigabytes, state-dict tensors
of other shapes and dtypes, damaged normalisers, truncations, flipped bits) given to ``compress``; crafted
``.npz`` files (deflate bombs, headers declaring huge shapes, wrong and object dtypes, truncated members)
given to ``compress --input``, ``evaluate --original`` and ``evaluate --restored``; re-signed corrections and
constants that do not fit their columns given to ``decompress``. Each case runs through ``run_tool`` in a
child process under ``RLIMIT_AS`` (``--headroom-mb`` above the address space after the imports); each
case's peak RSS is measured (``/proc/self/clear_refs``, then ``VmHWM``) and compared with the honest input's
for the same command.

Prints, per ``command x mutation class``: the case count, the largest peak RSS (MB) and the count of each
outcome (good: ``refused: one line, rc 2`` and, where the mutation can leave a valid input, ``accepted: rc 0,
valid output``; bad: ``traceback or rc 1``, ``signal or killed``, ``allocation beyond the memory limit``,
``stray files``, ``bad data written``, ``peak RSS beyond 2x the honest input's``, ``accepted a damaged
input (rc 0)``, ``rc 2, not one line``); then the bad cases. Writes the table, rc and signal counts per
class, the honest peak RSS per command and every bad case to ``benchmarks/results/fuzz.json``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fuzz.py [--n 3000] [--seed 29] [--headroom-mb 1024]``
(about a minute per thousand cases on one core). Exit code 1 when any case has a bad outcome.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests"), str(REPO)]

from baler_fuzz import (  # noqa: E402
    GOOD, build_all_cases, class_table, format_class_table, run_all,
)  # fmt: skip
from machine import machine_info, write_json_atomic  # noqa: E402


def build(folder: Path, n: int, seed: int, n_random: int):
    """Cases from ``seed``, ``seed + 1``, ... until at least ``n`` (each seed's names made unique)."""
    honest, cases = build_all_cases(folder / f"seed{seed}", seed, n_random)
    next_seed = seed + 1
    while len(cases) < n:
        _, more = build_all_cases(folder / f"seed{next_seed}", next_seed, n_random)
        for name, case in more.items():
            what, _, command = name.rpartition(" [")
            cases[f"{what} (seed {next_seed}) [{command}"] = case
        next_seed += 1
    return honest, cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000, help="at least this many cases (default 3000)")
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--random-per-kind", type=int, default=120,
                        help="seeded random checkpoint and npz mutations per seed (default 120)")
    parser.add_argument("--headroom-mb", type=int, default=1024,
                        help="address space the runner may add after its imports (MiB; default 1024)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one child may run before it is killed")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "fuzz.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="baler-fuzz-") as tmp:
        honest, cases = build(Path(tmp), args.n, args.seed, args.random_per_kind)
        results, verdicts, honest_rss = run_all(cases, honest, Path(tmp) / "run", args.headroom_mb * 2**20,
                                                args.timeout)
    rows = class_table(verdicts, results)
    print(format_class_table(rows))
    bad = {name: {"outcome": verdict, **{k: (results.get(name) or {}).get(k) for k in ("rc", "crash", "bad_data",
                                                                                       "left", "peak_rss")},
                  "stderr": (results.get(name) or {}).get("stderr", "")[-400:]}
           for name, verdict in verdicts.items() if verdict not in GOOD}
    print(f"\n{len(verdicts)} cases, {len(bad)} with a bad outcome; honest peak RSS (MB): "
          + ", ".join(f"{c} {rss / 2**20:.0f}" for c, rss in honest_rss.items()))
    for name, record in list(bad.items())[:60]:
        print(f"  {name}: {record['outcome']} {record['crash'] or record['bad_data'] or record['stderr'][-200:]!r}")
    write_json_atomic(args.out, {
        "cases": len(verdicts), "bad": len(bad), "seed": args.seed, "headroom_mb": args.headroom_mb,
        "honest_peak_rss_mb": {c: rss / 2**20 for c, rss in honest_rss.items()},
        "classes": rows, "bad_cases": bad, "machine": machine_info(threads=1),
    })  # fmt: skip
    print(f"wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
