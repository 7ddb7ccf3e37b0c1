"""``baler-lit convert-with-hls4ml``: Baler's ``--mode convert_with_hls4ml``, a trained model as an FPGA project.

The checkpoint's model (or only its encoder or decoder, ``--which``) goes through hls4ml's PyTorch front end
(``hls4ml.utils.config_from_pytorch_model`` and ``hls4ml.converters.convert_from_pytorch_model``), with Baler's
settings as options: ``--precision`` (default ``ap_fixed<16,8>``), ``--reuse-factor`` (1), ``--strategy``
(``latency``), ``--fpga-part`` (``xcvu9p-flga2104-2L-e``), ``--clock-period`` (5 ns), ``--io-type``
(``io_parallel``), ``--project-name``; the HLS project is written to ``--output-dir``. The model's inputs are the
normalised values (``x_norm = (x − min) / range`` with the checkpoint's minimum and range): the firmware takes
normalised inputs as the model does.

What each step needs (checked before anything is written; a missing part is one line and exit code 2):

- writing the project: hls4ml (``pip install hls4ml``; 1.3.0 pulls h5py, pyDigitalWaveTools and quantizers, no
  TensorFlow). Not part of the ``[baler]`` extra.
- ``--compile``: a C++ compiler (``g++``) to build hls4ml's C simulation; the firmware's outputs on rows of the
  checkpoint's own normalised range are then compared with the model's (fixed-point error in the report line).
- ``--build csim synth cosim export``: Vivado HLS (``vivado_hls``) or Vitis HLS (``vitis_hls``) on ``PATH``.

Models hls4ml converts are those made of layers it supports, each activation a layer of its own:
``FPGA_prototype_model`` is Baler's model for this, and ``AE`` converts too. Imports hls4ml and torch only when
run.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import BalerInputError

BUILD_STEPS = ("csim", "synth", "cosim", "export")
HLS_TOOLS = ("vitis_hls", "vivado_hls")
WHICH = ("model", "encoder", "decoder")
#: Rows of random normalised input the ``--compile`` check runs through the firmware and the model.
CHECK_ROWS = 64


@dataclass
class HlsSettings:
    """Baler's hls4ml config fields (its names in brackets)."""

    precision: str = "ap_fixed<16,8>"  # default_precision
    reuse_factor: int = 1  # default_reuse_factor
    strategy: str = "latency"  # Strategy
    fpga_part: str = "xcvu9p-flga2104-2L-e"  # Part
    clock_period: float = 5.0  # ClockPeriod, ns
    io_type: str = "io_parallel"  # IOType
    project_name: str = "baler_model"  # ProjectName
    backend: str = "Vivado"


def missing_parts(compile_: bool, build: list[str]) -> str | None:
    """One line naming what this machine lacks for the steps asked for, or ``None``."""
    import importlib.util

    missing = []
    if importlib.util.find_spec("hls4ml") is None:
        missing.append("hls4ml (pip install hls4ml)")
    if compile_ and shutil.which("g++") is None:
        missing.append("a C++ compiler (g++) for --compile")
    if build and not any(shutil.which(tool) for tool in HLS_TOOLS):
        missing.append(f"Vivado HLS or Vitis HLS ({' or '.join(HLS_TOOLS)} on PATH) for --build")
    if not missing:
        return None
    return "convert-with-hls4ml needs " + ", ".join(missing) + ", which this machine lacks"


def convert(ckpt: str | os.PathLike, output_dir: str | os.PathLike, settings: HlsSettings, which: str = "model",
            compile_: bool = False, build: list[str] | None = None, overwrite: bool = False) -> str:  # fmt: skip
    """Write the HLS project of the checkpoint's model to ``output_dir``; return a summary line."""
    build = list(build or [])
    if which not in WHICH:
        raise BalerInputError(f"--which must be one of {WHICH}, got {which!r}")
    bad = sorted(set(build) - set(BUILD_STEPS))
    if bad:
        raise BalerInputError(f"--build steps must be among {BUILD_STEPS}, got {bad}")
    if settings.reuse_factor < 1 or not settings.clock_period > 0:
        raise BalerInputError("--reuse-factor must be >= 1 and --clock-period > 0")
    missing = missing_parts(compile_, build)
    if missing:
        raise BalerInputError(missing)
    out = Path(output_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise BalerInputError(f"{out} exists and is not empty (use --overwrite to write into it)")

    import numpy as np
    import torch

    from .checkpoint import load_checkpoint
    from .models import BalerAutoencoder

    trained = load_checkpoint(ckpt)
    model: BalerAutoencoder = trained.model.float().eval()
    part = {"model": model, "encoder": model.encoder, "decoder": model.decoder}[which]
    shape = (model.latent_dim,) if which == "decoder" else tuple(model.input_shape)
    import hls4ml

    try:
        config = hls4ml.utils.config_from_pytorch_model(
            part, shape, granularity="name", backend=settings.backend, default_precision=settings.precision,
            default_reuse_factor=settings.reuse_factor,
        )
        config["Model"]["Strategy"] = settings.strategy
        hls_model = hls4ml.converters.convert_from_pytorch_model(
            part, output_dir=str(out), project_name=settings.project_name, backend=settings.backend,
            hls_config=config, io_type=settings.io_type, part=settings.fpga_part, clock_period=settings.clock_period,
        )
        hls_model.write()
    except (Exception, SystemExit) as exc:  # hls4ml raises many types for layers it does not support
        raise BalerInputError(f"hls4ml cannot convert the {which} of {trained.hparams.get('model', 'AE')}:"
                              f" {type(exc).__name__}: {exc}") from None  # fmt: skip
    line = f"wrote the hls4ml project of the {which} ({settings.backend}, {settings.precision}) to {out}"
    if compile_:
        hls_model.compile()
        x = np.random.default_rng(0).random((CHECK_ROWS, *shape), dtype=np.float32)
        with torch.no_grad():
            want = part(torch.from_numpy(x)).numpy()
        got = np.asarray(hls_model.predict(np.ascontiguousarray(x))).reshape(want.shape)
        line += f"; compiled: largest |firmware − model| on {CHECK_ROWS} rows {float(np.abs(got - want).max()):.3g}"
    if build:
        hls_model.build(**{step: step in build for step in BUILD_STEPS})
        line += f"; built ({', '.join(build)})"
    return line
