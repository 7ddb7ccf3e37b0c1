"""The ``baler-lit`` command.

``baler-lit fit|validate|test|predict [--config cfg.yaml | --config NAME] ...`` is a LightningCLI over
:class:`~baler_lit.module.BalerModule` and :class:`~baler_lit.data.BalerDataModule` (the data module's
``input_shape`` is linked to the model's). More subcommands work on files, and one lists the shipped configs::

    baler-lit compress   --ckpt best.ckpt --input data.npz --output data.baler [--latent-dtype float32]
                         [--max-relative-error 0.1] [--max-absolute-error 0.01]
    baler-lit decompress --input data.baler --output restored.npz
    baler-lit evaluate   --original data.npz --restored restored.npz --out report/ [--compressed data.baler]
    baler-lit diagnose   --ckpt best.ckpt --input data.npz --out diagnose/ [--tensorboard DIR]
    baler-lit info       data.baler [--json]
    baler-lit compress-many --ckpt best.ckpt --inputs a.npz b.npz ... --output-dir out/ [--devices 2]
    baler-lit configs      [NAME]

and Baler's other modes::

    baler-lit new-project WORKSPACE PROJECT [--root workspaces]      # Baler's newProject
    baler-lit convert-config workspaces/W/P/config/P_config.py --output P.yaml   # a Baler config → fit YAML
    baler-lit blocks --input data.npz --shape 10 25 --output blocks.npz        # Baler's convert_to_blocks
    baler-lit convert-with-hls4ml --ckpt best.ckpt --output-dir hls/ [--compile] [--build synth]

``--max-relative-error`` takes a fraction (0.1) or a percentage (``10%``, Baler's ``error_bounded_requirement``);
a bare number above 1 is refused with the fix. ``compress --extra-compression`` deflates the file (Baler's
``extra_compression``).

A ``--config`` value that is not a file but the name of a shipped config (``cms_ae``; ``baler-lit configs``
lists them) reads that config (:mod:`baler_lit.shipped_configs`), so the configs work from any folder and from
an installed wheel.

``baler-lit --help``, ``configs``, ``info`` and every file tool's ``--help`` import neither Lightning nor torch.
``compress-many`` is a Lightning ``predict`` run (DDP over ``--devices`` ranks, one shard of the inputs per rank,
one ``.baler`` per input and a ``manifest.json``); it is the one file tool that imports Lightning.

``compress`` and ``decompress`` stream ``.npy``/``.npz``/``.root`` data block by block (memory does not grow with the
row count). ``compress``, ``decompress``, ``evaluate``, ``diagnose`` and ``info`` never import Lightning: a
checkpoint is read with
``torch.load(weights_only=True)`` and the model is rebuilt from its hyper-parameters
(:func:`~baler_lit.checkpoint.load_checkpoint`), so these commands start in about the time torch takes to import.

Bad input gives one ``baler-lit: error: ...`` line on stderr, exit code 2 and no output file; an existing
output is replaced only with ``--overwrite``. Nothing is printed to stdout on import, so
``--print_config`` output stays valid YAML.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from .checkpoint import TrainedModel, adopt_training_dtypes, first_line, load_checkpoint
from .errors import BalerInputError

TOOLS = ("compress", "decompress", "evaluate", "diagnose", "info", "compress-many", "configs", "new-project",
         "convert-config", "blocks", "convert-with-hls4ml")
#: LightningCLI's subcommands (``baler-lit fit --help`` and the like list their options: that help needs Lightning)
TRAINING_COMMANDS = {
    "fit": "train a model (LightningCLI; e.g. baler-lit fit --config cms_ae)",
    "validate": "validate a trained model (LightningCLI)",
    "test": "test a trained model (LightningCLI)",
    "predict": "run a trained model over data (LightningCLI)",
}
HELP_OPTIONS = ("-h", "--help")
EXIT_BAD_INPUT = 2


class _OneLineParser(argparse.ArgumentParser):
    """argparse parser whose errors are a single line on stderr."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def relative_error(text: str) -> float:
    """``--max-relative-error``: a fraction (``0.1``) or a percentage (``10%``); a bare number above 1 is refused:
    Baler's ``error_bounded_requirement = 10`` means 10 %, and 10 as a fraction would allow 1000 %."""
    raw = text.strip()
    percent = raw.endswith("%")
    try:
        value = float(raw.removesuffix("%").strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number: give a fraction (0.1) or a percentage (10%)")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    if percent:
        return value / 100
    if value > 1:
        raise argparse.ArgumentTypeError(
            f"{raw} is a fraction above 1 (a {100 * value:g} % bound); for {value:g} % write {value:g}% or"
            f" {value / 100:g}"
        )
    return value


def _add_root_options(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--npz-key", default="data", help=f"array name of the {what} in an .npz file")
    p.add_argument("--root-tree", default=None, help="TTree name in a .root input (default: the only tree)")
    p.add_argument("--root-branches", nargs="+", default=None, help="branches to read from a .root input")
    p.add_argument("--root-prefix", default=None, help="read all numeric branches with this prefix, e.g. Jet_")


def _tool_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="baler-lit", description="Baler autoencoder compression with PyTorch Lightning.",
        epilog="`baler-lit COMMAND --help` describes a command; `baler-lit configs` lists the shipped configs.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser, metavar="COMMAND")
    for name, summary in TRAINING_COMMANDS.items():  # listed here; main() hands them to LightningCLI
        sub.add_parser(name, help=summary, add_help=False)

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
    c.add_argument("--max-relative-error", type=relative_error, default=None, metavar="FRACTION",
                   help="guarantee |restored - original| <= FRACTION x |original| for every value: 0.1 or 10%% (Baler's"
                   " error_bounded_requirement is in percent; a bare number above 1 is refused): values the network"
                   " misses are stored exactly in the file")
    c.add_argument("--extra-compression", action="store_true",
                   help="deflate the file's entries (Baler's extra_compression): smaller when the latent codes"
                   " repeat, slower to write")
    c.add_argument("--max-absolute-error", type=float, default=None, metavar="VALUE",
                   help="guarantee |restored - original| <= VALUE (the column's units) for every value; with"
                   " --max-relative-error the larger of the two limits applies")
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
    e.add_argument("--no-plots", action="store_true",
                   help="summary only (text and summary.json): no figures, so no matplotlib (~4 s quicker)")
    _add_root_options(e, "original data")

    m = sub.add_parser("compress-many", help="compress many files as a Lightning predict run over DDP ranks")
    m.add_argument("--ckpt", required=True, help="Lightning checkpoint of a BalerModule")
    m.add_argument("--inputs", required=True, nargs="+", help="data files (.npz, .npy or .root); one .baler each")
    m.add_argument("--output-dir", required=True, help="folder for <input stem>.baler and manifest.json")
    m.add_argument("--latent-dtype", default="float16", choices=["float64", "float32", "float16", "bfloat16"])
    m.add_argument("--max-relative-error", type=relative_error, default=None, metavar="FRACTION",
                   help="as for compress (0.1 or 10%%)")
    m.add_argument("--max-absolute-error", type=float, default=None, metavar="VALUE", help="as for compress")
    m.add_argument("--devices", type=int, default=1, help="ranks per node (processes on CPU, GPUs otherwise)")
    m.add_argument("--num-nodes", type=int, default=1, help="nodes")
    m.add_argument("--accelerator", default="cpu", help="Lightning accelerator (cpu, gpu, auto)")
    m.add_argument("--strategy", default="auto", help="Lightning strategy (default: ddp for more than one rank)")
    m.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    m.add_argument("--npz-key", default="data", help="array name of the data in .npz inputs")

    i = sub.add_parser("info", help="what a .baler file holds: columns, model, sizes of its parts, ratio, error")
    i.add_argument("file", help="compressed file (.baler)")
    i.add_argument("--json", action="store_true", help="print the description as JSON")

    g = sub.add_parser("diagnose", help="per-layer activation statistics of a trained model (Baler's diagnose)")
    g.add_argument("--ckpt", required=True, help="Lightning checkpoint of a BalerModule")
    g.add_argument("--input", required=True, help="data to run through the model (.npz or .root)")
    g.add_argument("--out", required=True, help="folder for diagnostics.png and activations.npz")
    g.add_argument("--tensorboard", default=None, help="also write histograms and the figure to this TensorBoard dir")
    g.add_argument("--max-rows", type=int, default=100_000, help="rows (samples) of the input to use, from the start")
    g.add_argument("--overwrite", action="store_true", help="write into an existing folder")
    _add_root_options(g, "data")

    s = sub.add_parser("configs", help="list the shipped configs (fit --config NAME reads them from any folder)")
    s.add_argument("name", nargs="?", default=None, help="print this shipped config's file path instead")

    n = sub.add_parser("new-project", help="Baler's newProject: a workspace and project with a config template")
    n.add_argument("workspace", help="workspace name (a folder below --root)")
    n.add_argument("project", help="project name (a folder below the workspace)")
    n.add_argument("--root", default="workspaces", help="folder holding the workspaces (default: workspaces, as Baler)")

    v = sub.add_parser("convert-config", help="a Baler config (config/*_config.py) → a YAML for baler-lit fit --config")
    v.add_argument("baler_config", help="the Baler config file; parsed, never run")
    v.add_argument("--output", required=True, help="YAML file to write")
    v.add_argument("--root", default=None,
                   help="folder Baler's relative paths start from (default: the folder above workspaces/)")
    v.add_argument("--overwrite", action="store_true", help="replace an existing output file")

    b = sub.add_parser("blocks", help="Baler's convert_to_blocks: the same values as samples of another shape")
    b.add_argument("--input", required=True, help="data file (.npz or .npy)")
    b.add_argument("--output", required=True, help="reshaped data to write (.npz)")
    b.add_argument("--shape", type=int, nargs="+", default=None, metavar="SIZE",
                   help="sample shape: H W for frames (Baler's convert_to_blocks [_, H, W]) or N for table rows")
    b.add_argument("--like", default=None, help="take the sample shape, names and dtypes of this file (to go back)")
    b.add_argument("--npz-key", default="data", help="array name of the data in an .npz file")
    b.add_argument("--overwrite", action="store_true", help="replace an existing output file")

    h = sub.add_parser("convert-with-hls4ml", help="Baler's convert_with_hls4ml: a trained model as an hls4ml project")
    h.add_argument("--ckpt", required=True, help="Lightning checkpoint of a BalerModule")
    h.add_argument("--output-dir", required=True, help="folder for the HLS project (Baler's OutputDir)")
    h.add_argument("--which", default="model", choices=["model", "encoder", "decoder"], help="what to convert")
    h.add_argument("--precision", default="ap_fixed<16,8>", help="default_precision (default ap_fixed<16,8>)")
    h.add_argument("--reuse-factor", type=int, default=1, help="default_reuse_factor (default 1)")
    h.add_argument("--strategy", default="latency", help="Strategy: latency or resource")
    h.add_argument("--fpga-part", default="xcvu9p-flga2104-2L-e", help="Part (default xcvu9p-flga2104-2L-e)")
    h.add_argument("--clock-period", type=float, default=5.0, help="ClockPeriod in ns (default 5)")
    h.add_argument("--io-type", default="io_parallel", help="IOType: io_parallel or io_stream")
    h.add_argument("--project-name", default="baler_model", help="ProjectName")
    h.add_argument("--compile", action="store_true",
                   help="compile the C simulation (g++) and compare its outputs with the model's")
    h.add_argument("--build", nargs="+", default=[], choices=["csim", "synth", "cosim", "export"],
                   help="run these steps of the HLS build (needs vivado_hls or vitis_hls on PATH)")
    h.add_argument("--overwrite", action="store_true", help="write into a non-empty output folder")
    return parser


def _auto_names(names: Sequence[str]) -> bool:
    return all(n == f"col_{i}" for i, n in enumerate(names))


def _compress(args: argparse.Namespace) -> str:
    from .compression import compress
    from .table import check_output

    check_output(args.output, args.overwrite)
    module = load_checkpoint(args.ckpt)
    table = _load_for_model(module, args, stream=True)
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
    adopt_training_dtypes(table, module.column_dtypes)
    bound = _error_bound(args)
    result = compress(
        module.model, module.normalizer, table, args.output, args.latent_dtype, dict(module.hparams), args.overwrite,
        strict=args.strict, error_bound=bound, extra_compression=args.extra_compression,
    )
    for line in result.warnings:
        print(f"baler-lit compress: warning: {line}", file=sys.stderr)
    lines = [
        f"compressed {result.n_rows} rows of {table.source} → {result.path}: {result.file_bytes} bytes"
        f" (original {result.original_bytes} bytes, ratio {result.ratio:.3f}, latent {result.latent_dim}"
        f" × {result.latent_dtype}) in {result.seconds:.3f} s",
        f"round-trip error measured on {result.roundtrip_rows} of the rows just compressed: mean normalised RMS"
        f" {result.roundtrip_mean_norm_rms:.4g}, worst column {result.roundtrip_max_norm_rms:.4g}",
    ]
    if result.constant_columns:
        lines.append(f"{result.constant_columns} constant column(s) stored exactly")
    if bound is not None:
        lines.append(
            f"error bound {bound.describe()} holds for every value: {result.corrections} of {result.n_values} values"
            f" corrected ({100 * result.corrected_share:.3g} %), {result.corrections_bytes} bytes"
            f" ({100 * result.corrections_bytes / result.file_bytes:.1f} % of the file)"
        )
    return "\n".join(lines)


def _load_for_model(module: TrainedModel, args: argparse.Namespace, stream: bool = False):
    """Read ``args.input`` (a row source streaming from disk if ``stream``, else a Table); a ROOT file without a
    branch choice gives the training columns in training order."""
    from .row_source import open_rows
    from .sources import load_table

    branches = args.root_branches
    if branches is None and args.root_prefix is None and Path(args.input).suffix.lower() == ".root":
        if module.column_names and not _auto_names(module.column_names):
            branches = module.column_names
    return (open_rows if stream else load_table)(args.input, args.npz_key, args.root_tree, branches, args.root_prefix)


def _diagnose(args: argparse.Namespace) -> str:
    from .diagnose import diagnose

    module = load_checkpoint(args.ckpt)
    table = _load_for_model(module, args)
    return diagnose(module.model, module.normalizer, table, args.out, args.tensorboard, args.max_rows, args.overwrite)


def _decompress(args: argparse.Namespace) -> str:
    from .compression import decompress_to_file

    result = decompress_to_file(args.input, args.output, overwrite=args.overwrite)
    return f"restored {result.n_rows} rows of shape {result.sample_shape} → {args.output} in {result.seconds:.3f} s"


def _error_bound(args: argparse.Namespace):
    if args.max_relative_error is None and args.max_absolute_error is None:
        return None
    from .error_bound import ErrorBound

    return ErrorBound(args.max_relative_error, args.max_absolute_error)


def _compress_many(args: argparse.Namespace) -> str:
    from .compress_many import compress_many

    results = compress_many(args.ckpt, args.inputs, args.output_dir, args.devices, args.accelerator, args.num_nodes,
                            args.strategy, latent_dtype=args.latent_dtype, error_bound=_error_bound(args),
                            overwrite=args.overwrite, npz_key=args.npz_key)  # fmt: skip
    lines = [f"{r['input']} → {r['output']}: {r['rows']} rows, ratio {r['ratio']:.3f}" for r in results]
    return "\n".join(lines + [f"this rank compressed {len(results)} of {len(args.inputs)} inputs; manifest:"
                              f" {Path(args.output_dir) / 'manifest.json'}"])  # fmt: skip


def _info(args: argparse.Namespace) -> str:
    import json

    from .info import file_info, format_info

    info = file_info(args.file)
    return json.dumps(info, indent=1) if args.json else format_info(info)


def _evaluate(args: argparse.Namespace) -> str:
    """The outputs are checked first, then the inputs' headers against each other, and only then are the inputs
    read whole (a deflated ``.npz`` inflated block by block): an input that does not fit the other, however
    large it declares itself, is refused before it takes any memory."""
    from .compression import read_compressed
    from .evaluate import check_comparable, check_compressed_matches, check_outputs, evaluate, format_summary
    from .row_source import open_rows

    check_outputs(args.out, args.tensorboard, args.overwrite)
    original = open_rows(args.original, args.npz_key, args.root_tree, args.root_branches, args.root_prefix)
    restored = open_rows(args.restored)
    check_comparable(original, restored)
    compressed = read_compressed(args.compressed) if args.compressed else None
    if compressed is not None:
        check_compressed_matches(original, compressed)
    summary = evaluate(original.to_table(), restored.to_table(), args.out, compressed, args.tensorboard,
                       overwrite=args.overwrite, plots=not args.no_plots)
    return format_summary(summary) + f"\nreport written to {args.out}"


def _configs(args: argparse.Namespace) -> str:
    from .shipped_configs import list_configs

    return list_configs(args.name)


def _new_project(args: argparse.Namespace) -> str:
    from .project import describe, new_project

    return describe(*new_project(args.workspace, args.project, args.root))


def _convert_config(args: argparse.Namespace) -> str:
    from .convert_config import convert_to_file

    converted = convert_to_file(args.baler_config, args.output, args.overwrite, args.root)
    lines = [f"wrote {args.output}: baler-lit fit --config {args.output}", *(f"then: {c}" for c in converted.commands)]
    if converted.unknown:
        lines.append("left out (not Baler fields baler-lit knows): " + ", ".join(converted.unknown))
    return "\n".join(lines)


def _blocks(args: argparse.Namespace) -> str:
    from .blocks import describe, reshape_file

    before, after = reshape_file(args.input, args.output, args.shape, args.like, args.overwrite, args.npz_key)
    return describe(before, after, args.output)


def _convert_with_hls4ml(args: argparse.Namespace) -> str:
    from .hls4ml_export import HlsSettings, convert

    settings = HlsSettings(args.precision, args.reuse_factor, args.strategy, args.fpga_part, args.clock_period,
                           args.io_type, args.project_name)  # fmt: skip
    return convert(args.ckpt, args.output_dir, settings, args.which, args.compile, args.build, args.overwrite)


def run_tool(argv: Sequence[str]) -> int:
    """Run a file tool (``compress``, ``decompress``, ``evaluate``, ``diagnose``, ``info``, ``compress-many``) or
    ``configs``, or print the top-level help (an empty ``argv`` or ``--help``); return the exit code."""
    args = _tool_parser().parse_args(list(argv))
    action = {"compress": _compress, "decompress": _decompress, "evaluate": _evaluate, "diagnose": _diagnose,
              "info": _info, "compress-many": _compress_many, "configs": _configs, "new-project": _new_project,
              "convert-config": _convert_config, "blocks": _blocks,
              "convert-with-hls4ml": _convert_with_hls4ml}[args.command]  # fmt: skip
    try:
        message = action(args)
    except (BalerInputError, OSError) as exc:  # OSError: a file system refusing what the user asked for
        print(f"baler-lit {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ModuleNotFoundError as exc:  # an optional package of the [baler] extra (uproot, matplotlib)
        from lightning_energy.extras import missing_extra_of

        missing = missing_extra_of(exc, f"baler-lit {args.command}")
        if missing is None:
            raise
        print(f"baler-lit {args.command}: error: {missing.feature} needs {missing.module}, which is not installed: "
              f"pip install 'lightning-energy[baler]'", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        print(message)
    except BrokenPipeError:  # `baler-lit info x.baler | head`: no traceback
        from lightning_energy.cli.main import reader_went_away

        return reader_went_away()
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


def lean_loop_settings(config: Any, kwargs: dict) -> dict:
    """The Trainer arguments that make the training loop cheaper (:mod:`baler_lit.lean_loop`), where the config
    leaves them to Lightning: :class:`~baler_lit.lean_loop.LeanProfiler` when no ``trainer.profiler`` is set, and
    a throttled progress bar (appended to ``trainer.callbacks`` of ``config``) when the bar is on and the config
    names none. Returns ``kwargs`` with the profiler added."""
    from lightning.pytorch.callbacks import ProgressBar

    from .lean_loop import LeanProfiler, lean_progress_bar

    kwargs = dict(kwargs)
    if config.get("trainer.profiler") is None and kwargs.get("profiler") is None:
        kwargs["profiler"] = LeanProfiler()
    callbacks = config.get("trainer.callbacks")
    callbacks = list(callbacks) if isinstance(callbacks, list) else [] if callbacks is None else [callbacks]
    if config.get("trainer.enable_progress_bar") is not False and not any(isinstance(c, ProgressBar)
                                                                         for c in callbacks):
        config["trainer.callbacks"] = [*callbacks, lean_progress_bar()]
    return kwargs


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if not isinstance(exc, OSError) or not text else f"{text} ({type(exc).__name__})"

def logger_dir_note(trainer: Any) -> str | None:
    """A note when an explicit logger's ``save_dir`` differs from ``trainer.default_root_dir`` (else ``None``).

    Without an explicit logger Lightning's default TensorBoard logger writes below ``default_root_dir`` (as the
    shipped configs do), so ``--trainer.default_root_dir`` moves logs, checkpoints and reports together. A
    logger with its own ``save_dir`` keeps writing there: say so instead of silently splitting the run.
    """
    if trainer is None:
        return None
    root = trainer.get("default_root_dir")
    loggers = trainer.get("logger")
    if root is None or loggers is None or isinstance(loggers, bool):
        return None
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        init = logger.get("init_args") if hasattr(logger, "get") else None
        save_dir = init.get("save_dir") if init is not None and hasattr(init, "get") else None
        if save_dir is not None and Path(str(save_dir)).resolve() != Path(str(root)).resolve():
            return (
                f"the logger writes to {save_dir}, not below trainer.default_root_dir {root};"
                " set --trainer.logger.init_args.save_dir too, or drop the logger to use the default one"
            )
    return None


def check_resumable(ckpt_path) -> None:
    """Refuse in one line (:class:`BalerInputError`) a ``fit --ckpt_path`` checkpoint this Lightning cannot resume
    from: not a Lightning checkpoint (no ``pytorch-lightning_version``), or written by a Lightning whose layout
    the installed one cannot upgrade (its migration raises). "last", "best", "hpc" and None are Lightning's own."""
    if ckpt_path is None or str(ckpt_path) in ("last", "best", "hpc", "registry"):
        return
    import lightning
    import torch

    from lightning_energy.integration.lightning_internals import migrate_checkpoint

    path = Path(ckpt_path)
    try:  # the tensors memory-mapped: a second read of a large checkpoint costs little
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except FileNotFoundError:
        raise BalerInputError(f"checkpoint {path} does not exist") from None
    except Exception as exc:
        raise BalerInputError(f"cannot load checkpoint {path}: {first_line(exc)}") from None
    if not isinstance(checkpoint, dict) or "pytorch-lightning_version" not in checkpoint:
        raise BalerInputError(f"{path} is not a Lightning checkpoint (no pytorch-lightning_version)")
    version = checkpoint["pytorch-lightning_version"]
    try:
        checkpoint = migrate_checkpoint(checkpoint, path)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise BalerInputError(f"checkpoint {path} was written by Lightning {version}; Lightning "
                              f"{lightning.__version__} cannot resume from it ({type(exc).__name__}: {exc})") from None
    if "optimizer_states" not in checkpoint or "loops" not in checkpoint:
        raise BalerInputError(f"checkpoint {path} holds the weights only (no optimizer state): it cannot resume a "
                              "fit; use it with compress, or resume from a full checkpoint (ModelCheckpoint's "
                              "save_last)")


def run_lightning(argv: Sequence[str] | None) -> int:
    """LightningCLI for fit/validate/test/predict; returns the exit code.

    ``argv=None`` lets LightningCLI read ``sys.argv`` itself (passing both makes it warn). A ``--config`` naming
    a shipped config is replaced by its path first (:func:`~baler_lit.shipped_configs.resolve_config_arguments`),
    before Lightning is imported.
    """
    from .shipped_configs import resolve_config_arguments

    try:
        if argv is None:
            sys.argv[1:] = resolve_config_arguments(sys.argv[1:])
        else:
            argv = resolve_config_arguments(argv)
    except BalerInputError as exc:
        print(f"baler-lit: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT

    from lightning_energy.extras import MissingExtra, check_installed

    try:
        check_installed("jsonargparse", "baler-lit's LightningCLI (fit, validate, test, predict)", extra="baler")
    except MissingExtra as exc:
        print(f"baler-lit: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
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
            return super().instantiate_trainer(**lean_loop_settings(config, kwargs))

        def before_fit(self) -> None:
            check_resumable(self.config_init.get("fit", self.config_init).get("ckpt_path"))

        def before_instantiate_classes(self) -> None:
            config = self.config.get(self.subcommand) if self.subcommand else self.config
            note = logger_dir_note(config.get("trainer"))
            if note:
                print(f"baler-lit: note: {note}", file=sys.stderr)

    try:
        BalerCLI(
            BalerModule,
            BalerDataModule,
            args=None if argv is None else list(argv),
            parser_kwargs={
                "description": "Baler autoencoder compression with PyTorch Lightning. Also: baler-lit compress|"
                "decompress|evaluate|diagnose|info|compress-many|configs|new-project|convert-config|blocks|"
                "convert-with-hls4ml --help. --config takes a file or the name of a shipped config (baler-lit"
                " configs lists them)."
            },
        )
    except (BalerInputError, MisconfigurationException) as exc:  # a setting that cannot work: the user's to fix
        print(f"baler-lit: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``baler-lit`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in TOOLS or args[0] in HELP_OPTIONS:  # no Lightning for these
        return run_tool(args)
    return run_lightning(None if argv is None else args)


if __name__ == "__main__":
    sys.exit(main())
