"""``lightning-energy estimate MODEL``: predict a model's training energy before training it.

The model is given as an import path of its class (``package.module.Class``, looked up from the current
directory first, as ``python -m`` looks up a module), its constructor arguments as JSON (an object for keyword
arguments, a list for positional ones) and the shape of one input batch. Prints the FLOPs/MACs table, the
theoretical figure (45 nm operation prices: a relative comparison between models, never joules to expect), the
layer fits and, with ``--probe``, the calibrated prediction: a short measured probe (``--probe-batches``
training batches on random inputs, twice, with ``--val-batches`` validation batches) extrapolated to the plan,
with its 95 % bound (:mod:`lightning_energy.predict.probe_run`); ``--json``
also writes them to a file (atomically). An input batch and model too large for the device's free memory
(``MEMORY_SHARE``) are refused before either is allocated.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import sys
from pathlib import Path

HELP = "predict a model's energy per training step and for a whole training run, before training"
DTYPES = ("float16", "bfloat16", "float32", "float64")
# One input batch and the model's parameters may take at most this share of the device's free memory: the
# forward pass and the layer benchmarks need the rest. A guard against sizes that cannot run, checked first.
MEMORY_SHARE = 0.5
FALLBACK_HOST_BYTES = 8 * 2**30  # assumed free host memory where the OS does not say (bytes)


def add_arguments(parser) -> None:
    parser.add_argument("model", help="import path of the model class, e.g. torch.nn.Linear or mymodel.Net "
                        "(mymodel.py in the current directory)")
    parser.add_argument("--init-args", default="{}", metavar="JSON",
                        help='constructor arguments: a JSON object (keywords) or list (positional); default {}')
    parser.add_argument("--input-shape", required=True, metavar="N,D,...",
                        help="shape of one input batch, batch first, e.g. 512,24")
    steps = parser.add_mutually_exclusive_group(required=True)
    steps.add_argument("--steps", type=int, help="planned training steps")
    steps.add_argument("--epochs", type=int, help="planned epochs (with --steps-per-epoch)")
    parser.add_argument("--steps-per-epoch", type=int, help="training steps per epoch (with --epochs)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="parameter and input dtype")
    parser.add_argument("--device", default="cpu", help="torch device for the model and benchmarks (cpu, cuda:0)")
    parser.add_argument("--bits", type=int, choices=(8, 16, 32, 64),
                        help="bit width for the 45 nm prices (default: from --dtype)")
    parser.add_argument("--no-empirical", action="store_true", help="skip the layer benchmarks")
    parser.add_argument("--bench-seconds", type=float, default=0.25,
                        help="seconds per benchmark point (default 0.25)")
    parser.add_argument("--probe", action="store_true",
                        help="calibrate: measure a short probe of training on random batches and extrapolate it "
                        "to the plan (joules to expect, with a 95%% bound)")
    parser.add_argument("--probe-batches", type=int, default=10, help="measured batches per probe epoch (>= 2)")
    parser.add_argument("--val-batches", type=int, default=0,
                        help="validation batches after each planned epoch, for --probe (default 0)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the estimate as JSON here")


def run(args) -> int:
    from lightning_energy.cli.commands import CommandError

    steps = _planned_steps(args, CommandError)
    if not args.bench_seconds > 0:
        raise CommandError(f"--bench-seconds must be > 0, got {args.bench_seconds}")
    if args.probe_batches < 2:
        raise CommandError(f"--probe-batches must be >= 2, got {args.probe_batches}")
    if args.val_batches < 0:
        raise CommandError(f"--val-batches must be >= 0, got {args.val_batches}")
    shape = _parse_shape(args.input_shape, CommandError)
    init = _parse_init_args(args.init_args, CommandError)
    model_class = _import_class(args.model, CommandError)

    import torch

    from lightning_energy.io import atomic_write_json
    from lightning_energy.predict.pre_run import estimate_energy

    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        raise CommandError(f"--device {args.device!r} is not a torch device ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CommandError(f"--device {args.device}: CUDA is not available on this machine")
    dtype = getattr(torch, args.dtype)
    _check_sizes(args, model_class, init, shape, device, dtype, CommandError)
    try:
        model = model_class(**init) if isinstance(init, dict) else model_class(*init)
    except Exception as err:
        raise CommandError(f"cannot build {args.model} with --init-args {args.init_args} "
                           f"({type(err).__name__}: {err})") from None
    if not isinstance(model, torch.nn.Module):
        raise CommandError(f"{args.model} built a {type(model).__name__}, not a torch.nn.Module")
    model = model.to(device=device, dtype=dtype)
    example = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    try:
        model(example)
    except Exception as err:
        raise CommandError(f"{args.model} cannot take an input of shape {tuple(shape)} "
                           f"({type(err).__name__}: {err})") from None
    estimate = estimate_energy(model, example, steps, bits=args.bits, empirical=not args.no_empirical,
                               min_seconds=args.bench_seconds)
    calibrated = None
    if args.probe:
        from lightning_energy.predict.probe_run import RunPlan, synthetic_probe

        epochs, per_epoch = (args.epochs, args.steps_per_epoch) if args.epochs is not None else (1, steps)
        calibrated = synthetic_probe(model, example, RunPlan(epochs, per_epoch, args.val_batches),
                                     probe_batches=args.probe_batches)
    print(estimate.format())
    if calibrated is not None:
        print(f"  {calibrated.format()}\n    (random inputs, a mean-square loss and Adam: your data loading, loss "
              "and optimizer are not in it; probe_fit() with your module and dataloaders measures them)")
    if args.json is not None:
        extra = {"calibrated": calibrated.as_dict()} if calibrated is not None else {}
        path = atomic_write_json(args.json, {"model": args.model, "init_args": init, "input_shape": shape,
                                             **estimate.as_dict(), **extra})
        print(f"written: {path}")
    return 0


def _check_sizes(args, model_class, init, shape: list[int], device, dtype, error) -> None:
    """Refuse, before anything real is allocated, an input batch and model whose bytes exceed
    ``MEMORY_SHARE`` of the memory free on ``device``: the model is first built on the ``meta`` device
    (shapes, no storage) to count its parameters and buffers; a model that cannot be built there is
    counted as 0 bytes (its real build then reports its own error)."""
    import torch

    item_bytes = torch.empty((), dtype=dtype).element_size()
    input_bytes = math.prod(shape) * item_bytes
    model_bytes = 0
    try:
        with torch.device("meta"):
            meta_model = model_class(**init) if isinstance(init, dict) else model_class(*init)
        if isinstance(meta_model, torch.nn.Module):
            model_bytes = sum(t.numel() for t in (*meta_model.parameters(), *meta_model.buffers())) * item_bytes
    except Exception:  # noqa: BLE001 (any failure here is the real build's to report)
        pass
    free_bytes = _free_memory_bytes(device)
    if input_bytes + model_bytes > MEMORY_SHARE * free_bytes:
        raise error(f"--input-shape {','.join(map(str, shape))} ({_size(input_bytes)} in {args.dtype}) and the "
                    f"model's parameters ({_size(model_bytes)}) need more than {MEMORY_SHARE:.0%} of the "
                    f"{_size(free_bytes)} free on {device}; give a smaller batch or model")


def _free_memory_bytes(device) -> int:
    """Bytes free on ``device`` now: the GPU's free memory, or the host's available physical memory."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no sysconf names here (not Linux): a modest host
        return FALLBACK_HOST_BYTES


def _size(n_bytes: float) -> str:
    """``n_bytes`` in the largest binary unit that keeps it >= 1 (``"2.5 GiB"``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n_bytes < 1024 or unit == "TiB":
            return f"{n_bytes:.3g} {unit}"
        n_bytes /= 1024


def _planned_steps(args, error) -> int:
    if args.steps is not None:
        if args.steps < 1:
            raise error(f"--steps must be >= 1, got {args.steps}")
        if args.steps_per_epoch is not None:
            raise error("--steps-per-epoch goes with --epochs, not with --steps")
        return args.steps
    if args.steps_per_epoch is None:
        raise error("--epochs needs --steps-per-epoch")
    if args.epochs < 1 or args.steps_per_epoch < 1:
        raise error(f"--epochs and --steps-per-epoch must be >= 1, got {args.epochs} and {args.steps_per_epoch}")
    return args.epochs * args.steps_per_epoch


def _parse_shape(text: str, error) -> list[int]:
    parts = [p.strip() for p in text.replace("x", ",").split(",") if p.strip()]
    try:
        shape = [int(p) for p in parts]
    except ValueError:
        shape = []
    if not shape or any(n < 1 for n in shape):
        raise error(f"--input-shape must be positive integers separated by commas, e.g. 512,24; got {text!r}")
    return shape


def _parse_init_args(text: str, error):
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"--init-args is not valid JSON ({err.msg} at position {err.pos}): {text!r}") from None
    if not isinstance(value, (dict, list)):
        raise error(f"--init-args must be a JSON object or list, got {type(value).__name__}: {text!r}")
    return value


def _import_class(path: str, error):
    """The class (or callable) at ``path``, ``module.Class``; the module is found as ``python -m`` finds one:
    the current directory first, then ``sys.path`` (the current directory only for this import)."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise error(f"model {path!r} must be an import path such as package.module.Class")
    try:
        with _current_directory_on_path():
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise error(f"cannot import module {module_name!r} for model {path!r} ({err})") from None
    if not hasattr(module, name):
        raise error(f"module {module_name!r} has no attribute {name!r}")
    target = getattr(module, name)
    if not callable(target):
        raise error(f"{path} is not a class or callable")
    return target


@contextlib.contextmanager
def _current_directory_on_path():
    """Within: the current directory first on ``sys.path`` (where ``python -m`` puts it; a console script's
    ``sys.path`` starts with its own folder instead), taken out again after unless it was there before."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(cwd)
