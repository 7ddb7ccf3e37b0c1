"""The ``baler-lit`` command.

``baler-lit fit|validate|test|predict [--config cfg.yaml] ...`` is a LightningCLI over
:class:`~baler_lit.module.BalerModule` and :class:`~baler_lit.data.BalerDataModule` (the data module's
``input_shape`` is linked to the model's). Three more subcommands work on files::

    baler-lit compress   --ckpt best.ckpt --input data.npz --output data.baler [--latent-dtype float32]
    baler-lit decompress --input data.baler --output restored.npz
    baler-lit evaluate   --original data.npz --restored restored.npz --out report/ [--compressed data.baler]

Bad input gives one ``baler-lit: error: ...`` line on stderr, exit code 2 and no output file; an existing
output is replaced only with ``--overwrite``. Nothing is printed to stdout on import, so
``--print_config`` output stays valid YAML.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from .errors import BalerInputError

TOOLS = ("compress", "decompress", "evaluate")
EXIT_BAD_INPUT = 2


class _OneLineParser(argparse.ArgumentParser):
    """argparse parser whose errors are a single line on stderr."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def _add_root_options(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--npz-key", default="data", help=f"array name of the {what} in an .npz file")
    p.add_argument("--root-tree", default=None, help="TTree name in a .root input (default: the only tree)")
    p.add_argument("--root-branches", nargs="+", default=None, help="branches to read from a .root input")
    p.add_argument("--root-prefix", default=None, help="read all numeric branches with this prefix, e.g. Jet_")


def _tool_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="baler-lit", description="Baler autoencoder compression tools.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)

    c = sub.add_parser("compress", help="encode a data file with a trained checkpoint into a .baler file")
    c.add_argument("--ckpt", required=True, help="Lightning checkpoint of a BalerModule")
    c.add_argument("--input", required=True, help="data to compress (.npz or .root)")
    c.add_argument("--output", required=True, help="compressed file to write (.baler)")
    c.add_argument(
        "--latent-dtype", default="float16", choices=["float64", "float32", "float16", "bfloat16"],
        help="storage dtype of the latent codes (default float16: the demo's ratio, 2.9 against float32's 1.5 on "
        "the CMS AE, at float32's error there (evaluate --compressed shows the trade-off for your data); a latent "
        "beyond float16's ±65504 is refused with a clear message)",
    )  # fmt: skip
    c.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    c.add_argument("--strict", action="store_true",
                   help="refuse input outside the checkpoint's normalisation range instead of warning")
    _add_root_options(c, "data")

    d = sub.add_parser("decompress", help="restore a .baler file to an .npz file")
    d.add_argument("--input", required=True, help="compressed file (.baler)")
    d.add_argument("--output", required=True, help="restored data to write (.npz)")
    d.add_argument("--overwrite", action="store_true", help="replace an existing output file")

    e = sub.add_parser("evaluate", help="compare original and restored data; write summaries and plots")
    e.add_argument("--original", required=True, help="original data (.npz or .root)")
    e.add_argument("--restored", required=True, help="restored data (.npz)")
    e.add_argument("--out", required=True, help="report folder to create")
    e.add_argument("--compressed", default=None, help=".baler file: adds the ratio and the ratio/error trade-off")
    e.add_argument("--tensorboard", default=None, help="also write the figures and scalars to this TensorBoard dir")
    e.add_argument("--overwrite", action="store_true", help="write into an existing report folder")
    _add_root_options(e, "original data")
    return parser


def load_checkpoint(path: str | Path):
    """Load a BalerModule checkpoint on the CPU with ``weights_only=True`` (no arbitrary unpickling)."""
    from .module import BalerModule

    p = Path(path)
    if not p.is_file():
        raise BalerInputError(f"checkpoint {p} does not exist")
    try:
        module = BalerModule.load_from_checkpoint(p, map_location="cpu", weights_only=True)
    except BalerInputError:
        raise
    except Exception as exc:  # torch/Lightning raise many types for damaged or foreign files
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BalerInputError(f"cannot load checkpoint {p}: {first}") from None
    if module.normalizer is None:
        raise BalerInputError(f"checkpoint {p} holds no normalisation (train it with BalerDataModule)")
    return module.eval()


def _auto_names(names: Sequence[str]) -> bool:
    return all(n == f"col_{i}" for i, n in enumerate(names))


def _compress(args: argparse.Namespace) -> str:
    from .compression import compress
    from .sources import load_table
    from .table import check_output

    check_output(args.output, args.overwrite)
    module = load_checkpoint(args.ckpt)
    branches = args.root_branches
    if branches is None and args.root_prefix is None and Path(args.input).suffix.lower() == ".root":
        if module.column_names and not _auto_names(module.column_names):
            branches = module.column_names  # the training columns, in training order
    table = load_table(args.input, args.npz_key, args.root_tree, branches, args.root_prefix)
    names = module.column_names
    if (
        names and not table.is_frames and not _auto_names(names) and not _auto_names(table.names)
        and list(table.names) != list(names)
    ):  # fmt: skip
        diff = next((i for i, (a, b) in enumerate(zip(names, table.names)) if a != b), min(len(names), table.n_columns))
        raise BalerInputError(
            f"column mismatch: {args.input} has {table.n_columns} columns, the checkpoint {len(names)};"
            f" first difference at column {diff}"
        )
    result = compress(
        module.model, module.normalizer, table, args.output, args.latent_dtype, dict(module.hparams), args.overwrite,
        strict=args.strict,
    )
    for line in result.warnings:
        print(f"baler-lit compress: warning: {line}", file=sys.stderr)
    return (
        f"compressed {result.n_rows} rows of {table.source} → {result.path}: {result.file_bytes} bytes"
        f" (original {result.original_bytes} bytes, ratio {result.ratio:.3f}, latent {result.latent_dim}"
        f" × {result.latent_dtype}) in {result.seconds:.3f} s\n"
        f"round-trip error measured on {result.roundtrip_rows} of the rows just compressed: mean normalised RMS"
        f" {result.roundtrip_mean_norm_rms:.4g}, worst column {result.roundtrip_max_norm_rms:.4g}"
    )


def _decompress(args: argparse.Namespace) -> str:
    from .compression import decompress

    table = decompress(args.input, args.output, overwrite=args.overwrite)
    return f"restored {table.n_rows} rows of shape {table.sample_shape} → {args.output}"


def _evaluate(args: argparse.Namespace) -> str:
    from .compression import read_compressed
    from .evaluate import evaluate, format_summary
    from .sources import load_table

    original = load_table(args.original, args.npz_key, args.root_tree, args.root_branches, args.root_prefix)
    restored = load_table(args.restored)
    compressed = read_compressed(args.compressed) if args.compressed else None
    summary = evaluate(original, restored, args.out, compressed, args.tensorboard, overwrite=args.overwrite)
    return format_summary(summary) + f"\nreport written to {args.out}"


def run_tool(argv: Sequence[str]) -> int:
    """Run ``compress``, ``decompress`` or ``evaluate``; return the exit code."""
    args = _tool_parser().parse_args(list(argv))
    action = {"compress": _compress, "decompress": _decompress, "evaluate": _evaluate}[args.command]
    try:
        message = action(args)
    except (BalerInputError, OSError) as exc:  # OSError: a file system refusing what the user asked for
        print(f"baler-lit {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(message)
    return 0


def _keep_one_energy_callback(callbacks: list) -> list:
    """Config fragments append callbacks: keep one EnergyCallback (see :mod:`baler_lit.compose`), say which."""
    from lightning.pytorch.utilities import rank_zero_info

    from .compose import describe_energy_callback, is_energy_callback, one_energy_callback

    kept, dropped = one_energy_callback(callbacks)
    if dropped:
        (energy,) = [c for c in kept if is_energy_callback(c)]
        rank_zero_info(f"baler-lit: {len(dropped) + 1} EnergyCallbacks configured; measuring with "
                       f"{describe_energy_callback(energy)} (the last that names its sensors, else the last); "
                       "left out: " + ", ".join(describe_energy_callback(c) for c in dropped))
    return kept


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if not isinstance(exc, OSError) or not text else f"{text} ({type(exc).__name__})"


def run_lightning(argv: Sequence[str] | None) -> int:
    """LightningCLI for fit/validate/test/predict; returns the exit code.

    ``argv=None`` lets LightningCLI read ``sys.argv`` itself (passing both makes it warn).
    """
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from .data import BalerDataModule
    from .module import BalerModule

    class BalerCLI(LightningCLI):
        def add_arguments_to_parser(self, parser) -> None:
            parser.link_arguments("data.input_shape", "model.input_shape", apply_on="instantiate")

        def instantiate_trainer(self, **kwargs):
            # before the Trainer sees them: two EnergyCallbacks of one state key make it raise
            config = self.config_init.get(str(self.subcommand), self.config_init)
            callbacks = config.get("trainer.callbacks")
            if isinstance(callbacks, list):
                config["trainer.callbacks"] = _keep_one_energy_callback(callbacks)
            return super().instantiate_trainer(**kwargs)

    try:
        BalerCLI(
            BalerModule,
            BalerDataModule,
            args=None if argv is None else list(argv),
            parser_kwargs={
                "description": "Baler autoencoder compression with PyTorch Lightning. Also: baler-lit compress|"
                "decompress|evaluate --help"
            },
        )
    except (BalerInputError, MisconfigurationException) as exc:  # a setting that cannot work: the user's to fix
        print(f"baler-lit: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``baler-lit`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in TOOLS:
        return run_tool(args)
    return run_lightning(None if argv is None else args)


if __name__ == "__main__":
    sys.exit(main())
