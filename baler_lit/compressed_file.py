"""A verified ``.baler`` file (:func:`read_compressed`, :class:`CompressedFile`), readable without torch.

Opening and verifying a file (every header field, the checksum over every byte: see
:mod:`baler_lit.file_format`) needs numpy only, so ``baler-lit info`` never imports torch; torch is imported
by the methods that decode (:meth:`CompressedFile.stream`, :attr:`CompressedFile.latent`,
:meth:`CompressedFile.decoder_model`). Compression and decoding are in :mod:`baler_lit.compression`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import os
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from .error_bound import CorrectionReader
from .errors import BalerInputError, existing_file
from .file_format import (
    CORRECTION_ARRAYS,
    LATENT_DTYPES,
    MODEL_DTYPES,
    array_entry,
    check_archive,
    check_header,
    check_values,
    read_header,
    verify_arrays,
)
from .normalization import MinMaxNormalizer
from .table import DtypeRestorer

if TYPE_CHECKING:
    import torch

    from .models import BalerAutoencoder

#: A model rebuilt from a file may hold at most this many times the bytes of its stored decoder (its
#: encoder mirrors the decoder) plus ``MODEL_SLACK_BYTES``: header fields cannot make the reader allocate more.
MODEL_SIZE_FACTOR = 3
MODEL_SLACK_BYTES = 2**20


@dataclass
class CompressedFile:
    """A parsed ``.baler`` file: its header and its arrays (by name)."""

    path: Path
    header: dict[str, Any]
    arrays: dict[str, np.ndarray]
    #: arrays verified but not kept in memory (``read_compressed(stream_latent=True)``): name → SHA-256
    streamed: dict[str, str] = field(default_factory=dict)

    @property
    def n_rows(self) -> int:
        return int(self.header["n_rows"])

    def storage_dtype(self) -> np.dtype:
        """The dtype of the restored ``data`` array (see :class:`~baler_lit.table.DtypeRestorer`)."""
        h = self.header
        return DtypeRestorer(h["dtypes"], h["frames"], self.arrays["data_min"], self.arrays["data_max"]).storage

    @contextlib.contextmanager
    def stream(self):
        """``(latent blocks, corrections)`` for one pass over the file: ``latent_blocks(step)`` yields the
        latent codes (torch, storage dtype) ``step`` rows at a time; ``corrections`` is a
        :class:`~baler_lit.error_bound.CorrectionReader` or ``None``. Arrays not held in memory are re-read
        from the archive and must hash to the digests verified when the file was opened."""
        h = self.header
        latent_dtype = h["latent_dtype"]
        row_bytes = h["model"]["latent_dim"] * LATENT_DTYPES[latent_dtype][1].itemsize
        with contextlib.ExitStack() as stack:
            readers: dict[str, _HashingReader] = {}
            zf = None

            def source(name: str) -> BinaryIO:
                nonlocal zf
                if name in self.arrays:
                    return io.BytesIO(memoryview(self.arrays[name]).cast("B"))
                if zf is None:
                    zf = stack.enter_context(_open_archive(self.path))
                readers[name] = _HashingReader(stack.enter_context(zf.open(array_entry(name))))
                return readers[name]

            def latent_blocks(step: int) -> Iterator[torch.Tensor]:
                fh = source("latent")
                for s in range(0, self.n_rows, step):
                    n = min(step, self.n_rows - s)
                    raw = fh.read(n * row_bytes)
                    if len(raw) != n * row_bytes:
                        raise BalerInputError(f"{self.path} changed while it was read (latent codes too short)")
                    block = np.frombuffer(raw, dtype=LATENT_DTYPES[latent_dtype][1]).reshape(n, -1)
                    yield _latent_tensor(block.copy(), latent_dtype)

            corrections = None
            spec = h.get("corrections")
            if spec is not None:
                corrections = CorrectionReader(
                    source("corrections_index"), source("corrections_value"), spec["count"], spec["value_dtype"],
                    self.n_rows * math.prod(h["sample_shape"]), self.path,
                )
            yield latent_blocks, corrections
            self._check_reread(readers)

    def _check_reread(self, readers: dict[str, _HashingReader]) -> None:
        for name, reader in readers.items():
            if reader.fh.read(1) or reader.digest.hexdigest() != self.streamed[name]:
                raise BalerInputError(f"{self.path} changed while it was read ({name} differs from the verified bytes)")

    @property
    def file_bytes(self) -> int:
        return self.path.stat().st_size

    @property
    def latent(self) -> torch.Tensor:
        """Latent codes as stored, as a torch tensor in the storage dtype (a file opened with ``stream_latent``
        has them on disk only: use :meth:`stream`)."""
        return _latent_tensor(self.arrays["latent"], self.header["latent_dtype"])

    def normalizer(self) -> MinMaxNormalizer:
        return MinMaxNormalizer.from_arrays(self.arrays)

    def decoder_model(self) -> BalerAutoencoder:
        """Rebuild the model and load the stored decoder weights (the encoder stays untrained).

        The model is first built on the ``meta`` device (no memory): its decoder must match the stored
        arrays name for name, shape for shape and dtype for dtype, and the whole model may hold at most
        ``MODEL_SIZE_FACTOR`` times the stored decoder's bytes, before it is built for real.
        """
        spec = self.header["model"]
        stored = {n.removeprefix("decoder."): arr for n, arr in self.arrays.items() if n.startswith("decoder.")}
        import torch

        with torch.device("meta"):
            blueprint = self._build(spec)
        expected = blueprint.decoder.state_dict()
        if set(expected) != set(stored):
            missing, extra = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
            raise BalerInputError(
                f"{self.path}: decoder weights do not fit the model description (missing {missing[:3]},"
                f" unexpected {extra[:3]})"
            )
        for name, t in expected.items():
            want = MODEL_DTYPES[spec["dtype"]] if t.is_floating_point() else _numpy_dtype(t.dtype).str
            if tuple(t.shape) != stored[name].shape or stored[name].dtype.str != want:
                raise BalerInputError(
                    f"{self.path}: decoder weight {name!r} is {stored[name].dtype.str} {stored[name].shape},"
                    f" the model description needs {want} {tuple(t.shape)}"
                )
        model_bytes = sum(t.numel() * t.element_size() for t in [*blueprint.parameters(), *blueprint.buffers()])
        decoder_bytes = sum(arr.nbytes for arr in stored.values())
        if model_bytes > MODEL_SIZE_FACTOR * decoder_bytes + MODEL_SLACK_BYTES:
            raise BalerInputError(
                f"{self.path}: the model description needs {model_bytes} bytes of weights for a stored decoder"
                f" of {decoder_bytes} bytes"
            )
        model = self._build(spec)
        state = {name: torch.from_numpy(arr) for name, arr in stored.items()}
        try:
            model.decoder.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise BalerInputError(f"{self.path}: decoder weights do not fit the model description: {exc}") from None
        return model.eval()

    def _build(self, spec: dict[str, Any]) -> BalerAutoencoder:
        from .models import build_model

        try:
            return build_model(
                spec["name"], spec["input_shape"], spec["latent_dim"], dtype=spec["dtype"], model_kwargs=spec["kwargs"]
            )
        except BalerInputError as exc:
            raise BalerInputError(f"{self.path}: the model description is invalid: {exc}") from None
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise BalerInputError(f"{self.path}: the model description is invalid ({type(exc).__name__})") from None


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    import torch

    return torch.empty((), dtype=dtype).numpy().dtype


def _latent_tensor(latent: np.ndarray, latent_dtype: str) -> torch.Tensor:
    """Stored latent bytes as a torch tensor of the latent dtype (bfloat16 bit patterns reinterpreted)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(latent))
    return t.view(torch.bfloat16) if latent_dtype == "bfloat16" else t


def read_compressed(path: str | os.PathLike, stream_latent: bool = False) -> CompressedFile:
    """Open and verify a ``.baler`` file; raise :class:`BalerInputError` naming what is wrong.

    Checks, in order (see :mod:`baler_lit.file_format`): the archive's entries, the header's size and
    every field, then the arrays while the checksum is computed; memory is bounded by the file's size.
    With ``stream_latent`` the latent codes and the corrections are checksummed but not kept: decoding reads
    them again block by block (:meth:`CompressedFile.stream`) and checks that they are the bytes verified.
    """
    p = existing_file(path, "compressed file")
    try:
        file_bytes = p.stat().st_size
        zf = zipfile.ZipFile(p)
    except zipfile.BadZipFile:
        raise BalerInputError(f"{p} is truncated or not a baler-lit compressed file (no valid zip directory)") from None
    except (OSError, ValueError, EOFError) as exc:
        raise BalerInputError(f"cannot read compressed file {p}: {_one_line(exc)}") from None
    with zf:
        try:
            check_archive(zf, p, file_bytes)
            header = read_header(zf, p)
            check_header(header, p, {info.filename: info.file_size for info in zf.infolist()})
            skip = frozenset({"latent", *CORRECTION_ARRAYS}) if stream_latent else frozenset()
            arrays, streamed = verify_arrays(zf, header, p, skip)
        except BalerInputError:
            raise
        except (zipfile.BadZipFile, EOFError, OSError, ValueError, TypeError, KeyError, zlib.error) as exc:
            raise BalerInputError(f"{p} is truncated or corrupted: {_one_line(exc)}") from None
    check_values(arrays, p, math.prod(header["sample_shape"]))
    compressed = CompressedFile(path=p, header=header, arrays=arrays, streamed=streamed)
    compressed.normalizer()  # its own checks: finite, range > 0
    return compressed


def _open_archive(path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise BalerInputError(f"{path} changed while it was read: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:200] if text else type(exc).__name__


class _HashingReader:
    """A binary reader that hashes what passes through it (to check a re-read against the verified digest)."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.digest = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(n)
        self.digest.update(data)
        return data
