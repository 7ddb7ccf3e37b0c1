"""Baler's autoencoders, with every layer size derived from the data shape.

Three models share one interface (:class:`BalerAutoencoder`): ``encoder`` and ``decoder`` sub-modules,
``encode(x) -> z``, ``decode(z) -> x_hat`` and ``forward(x) -> x_hat``. Inputs are min-max normalised
values (dimensionless, nominally in [0, 1]); ``z`` has ``latent_dim`` features per sample.

- :class:`AE`: Baler's ``AE`` — encoder n→200→100→50→z, decoder z→50→100→200→n, LeakyReLU (slope 0.01)
  between layers, no activation on ``z`` or on the output.
- :class:`AE_Dropout_BN`: Baler's ``AE_Dropout_BN`` — same sizes, dropout 0.5/0.4/0.3/0.2 in the encoder,
  BatchNorm in the decoder, ReLU on the output (as in the original).
- :class:`ConvAE`: a convolutional autoencoder for 2-D frames (for example Baler's 50×50 CFD frames).
  Unlike the original conv AEs, which hard-code a flattened size, the flattened size and the transposed
  convolutions' output padding are computed from the frame shape, so any H×W works.

:func:`build_model` creates a model by name from JSON-friendly arguments, so a compressed file can rebuild
its decoder without unpickling anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .errors import BalerInputError

#: LeakyReLU negative slope used by Baler (PyTorch's default for ``F.leaky_relu``).
LEAKY_SLOPE = 0.01
#: Hidden layer widths of Baler's dense autoencoders, encoder side (the decoder mirrors them).
BALER_HIDDEN = (200, 100, 50)
#: Dropout probabilities after each encoder layer of ``AE_Dropout_BN`` (Baler's values).
BALER_DROPOUT = (0.5, 0.4, 0.3, 0.2)
#: Baler's default compression ratio (24 columns → 15 latent features).
DEFAULT_COMPRESSION_RATIO = 1.6

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """Return the torch dtype for ``"float32"`` or ``"float64"`` (the only training dtypes supported)."""
    if isinstance(name, torch.dtype):
        if name in DTYPES.values():
            return name
        raise BalerInputError(f"dtype must be float32 or float64, got {name}")
    try:
        return DTYPES[str(name)]
    except KeyError:
        raise BalerInputError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def latent_size(n_features: int, compression_ratio: float) -> int:
    """Baler's latent-size rule: ``z = ceil(n_features / compression_ratio)`` (ratio 1.6, 24 → 15)."""
    if n_features < 1:
        raise BalerInputError(f"n_features must be >= 1, got {n_features}")
    if not compression_ratio > 0:
        raise BalerInputError(f"compression_ratio must be > 0, got {compression_ratio}")
    return max(1, math.ceil(n_features / compression_ratio))


class BalerAutoencoder(nn.Module):
    """Common interface: ``encoder``, ``decoder``, ``input_shape`` (one sample) and ``latent_dim``."""

    encoder: nn.Module
    decoder: nn.Module

    def __init__(self, input_shape: Sequence[int], latent_dim: int) -> None:
        super().__init__()
        shape = tuple(int(s) for s in input_shape)
        if not shape or any(s < 1 for s in shape):
            raise BalerInputError(f"input_shape must be non-empty positive sizes, got {tuple(input_shape)}")
        if int(latent_dim) < 1:
            raise BalerInputError(f"latent_dim must be >= 1, got {latent_dim}")
        self.input_shape = shape
        self.latent_dim = int(latent_dim)
        #: extra constructor arguments, recorded by :func:`build_model` for rebuilding from a file
        self.build_kwargs: dict[str, Any] = {}

    @property
    def n_features(self) -> int:
        """Number of values in one sample (columns of a table row, or pixels of a frame)."""
        return math.prod(self.input_shape)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Map a batch of normalised samples ``(B, *input_shape)`` to latent codes ``(B, latent_dim)``."""
        return self.encoder(x)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Map latent codes ``(B, latent_dim)`` back to normalised samples ``(B, *input_shape)``."""
        return self.decoder(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))


def _require_table(name: str, input_shape: Sequence[int]) -> int:
    if len(input_shape) != 1:
        raise BalerInputError(
            f"model {name} needs table rows (input_shape = (n_columns,)), got input_shape {tuple(input_shape)};"
            " use ConvAE for 2-D frames"
        )
    return int(input_shape[0])


def _dense_stack(sizes: Sequence[int], slope: float) -> nn.Sequential:
    """Linear layers through ``sizes`` with LeakyReLU between them and none after the last one."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(sizes) - 2:
            layers.append(nn.LeakyReLU(slope))
    return nn.Sequential(*layers)


class AE(BalerAutoencoder):
    """Baler's ``AE``: n→200→100→50→z→50→100→200→n with LeakyReLU(0.01) between layers."""

    def __init__(
        self,
        input_shape: Sequence[int],
        latent_dim: int,
        hidden: Sequence[int] = BALER_HIDDEN,
        negative_slope: float = LEAKY_SLOPE,
    ) -> None:
        super().__init__(input_shape, latent_dim)
        n = _require_table("AE", self.input_shape)
        hidden = [int(h) for h in hidden]
        self.encoder = _dense_stack([n, *hidden, self.latent_dim], negative_slope)
        self.decoder = _dense_stack([self.latent_dim, *reversed(hidden), n], negative_slope)


class AE_Dropout_BN(BalerAutoencoder):  # noqa: N801 - Baler's class name
    """Baler's ``AE_Dropout_BN``: dropout 0.5/0.4/0.3/0.2 in the encoder, BatchNorm in the decoder.

    Layer order as in the original: encoder ``Linear → Dropout → LeakyReLU`` four times (so the latent code
    passes a LeakyReLU too); decoder ``Linear → LeakyReLU → BatchNorm`` three times, then
    ``Linear → BatchNorm → ReLU``.
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        latent_dim: int,
        hidden: Sequence[int] = BALER_HIDDEN,
        dropout: Sequence[float] = BALER_DROPOUT,
        negative_slope: float = LEAKY_SLOPE,
    ) -> None:
        super().__init__(input_shape, latent_dim)
        n = _require_table("AE_Dropout_BN", self.input_shape)
        hidden = [int(h) for h in hidden]
        enc_sizes = [n, *hidden, self.latent_dim]
        if len(dropout) != len(enc_sizes) - 1:
            raise BalerInputError(
                f"AE_Dropout_BN needs {len(enc_sizes) - 1} dropout probabilities, got {len(dropout)}"
            )
        enc: list[nn.Module] = []
        for (n_in, n_out), p in zip(zip(enc_sizes[:-1], enc_sizes[1:]), dropout):
            enc += [nn.Linear(n_in, n_out), nn.Dropout(float(p)), nn.LeakyReLU(negative_slope)]
        self.encoder = nn.Sequential(*enc)
        dec_sizes = [self.latent_dim, *reversed(hidden)]
        dec: list[nn.Module] = []
        for n_in, n_out in zip(dec_sizes[:-1], dec_sizes[1:]):
            dec += [nn.Linear(n_in, n_out), nn.LeakyReLU(negative_slope), nn.BatchNorm1d(n_out)]
        dec += [nn.Linear(dec_sizes[-1], n), nn.BatchNorm1d(n), nn.ReLU()]
        self.decoder = nn.Sequential(*dec)


def _conv_out(size: int) -> int:
    """Output length of a kernel-3, stride-2, padding-1 convolution."""
    return (size - 1) // 2 + 1


class ConvAE(BalerAutoencoder):
    """Convolutional autoencoder for 2-D frames ``(H, W)`` or ``(C, H, W)``.

    Encoder: ``len(channels)`` stride-2 3×3 convolutions with LeakyReLU, flatten, Linear → z. Decoder: Linear →
    LeakyReLU, unflatten, stride-2 3×3 transposed convolutions whose ``output_padding`` is chosen per layer so
    the output has exactly the input's H×W, no activation on the output. 50×50 frames with the default
    channels give 50→25→13→7 and a flattened size of 16·7·7 = 784.
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        latent_dim: int,
        channels: Sequence[int] = (8, 16, 16),
        negative_slope: float = LEAKY_SLOPE,
    ) -> None:
        super().__init__(input_shape, latent_dim)
        if len(self.input_shape) == 2:
            in_ch, height, width = 1, *self.input_shape
            self._add_channel = True
        elif len(self.input_shape) == 3:
            in_ch, height, width = self.input_shape
            self._add_channel = False
        else:
            raise BalerInputError(
                f"ConvAE needs frames (input_shape (H, W) or (C, H, W)), got input_shape {self.input_shape};"
                " use AE for table rows"
            )
        channels = [int(c) for c in channels]
        if not channels or any(c < 1 for c in channels):
            raise BalerInputError(f"ConvAE channels must be positive, got {channels}")
        sizes = [(height, width)]
        for _ in channels:
            h, w = sizes[-1]
            sizes.append((_conv_out(h), _conv_out(w)))
        flat = channels[-1] * sizes[-1][0] * sizes[-1][1]

        enc: list[nn.Module] = []
        prev = in_ch
        for ch in channels:
            enc += [nn.Conv2d(prev, ch, 3, stride=2, padding=1), nn.LeakyReLU(negative_slope)]
            prev = ch
        enc += [nn.Flatten(1), nn.Linear(flat, self.latent_dim)]
        self.encoder = nn.Sequential(*enc)

        dec: list[nn.Module] = [
            nn.Linear(self.latent_dim, flat),
            nn.LeakyReLU(negative_slope),
            nn.Unflatten(1, (channels[-1], *sizes[-1])),
        ]
        out_channels = [*reversed(channels[:-1]), in_ch]
        prev = channels[-1]
        for i, ch in enumerate(out_channels):
            (h_in, w_in), (h_out, w_out) = sizes[-1 - i], sizes[-2 - i]
            pad = (h_out - (2 * h_in - 1), w_out - (2 * w_in - 1))
            dec.append(nn.ConvTranspose2d(prev, ch, 3, stride=2, padding=1, output_padding=pad))
            if i < len(out_channels) - 1:
                dec.append(nn.LeakyReLU(negative_slope))
            prev = ch
        self.decoder = nn.Sequential(*dec)
        self.flat_size = flat

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x.unsqueeze(1) if self._add_channel else x)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        out = self.decoder(z)
        return out.squeeze(1) if self._add_channel else out


MODELS: dict[str, type[BalerAutoencoder]] = {"AE": AE, "AE_Dropout_BN": AE_Dropout_BN, "ConvAE": ConvAE}


def build_model(
    name: str,
    input_shape: Sequence[int],
    latent_dim: int | None = None,
    compression_ratio: float = DEFAULT_COMPRESSION_RATIO,
    dtype: str | torch.dtype = "float32",
    model_kwargs: dict[str, Any] | None = None,
) -> BalerAutoencoder:
    """Create model ``name`` for samples of ``input_shape``.

    ``latent_dim`` wins over ``compression_ratio``; otherwise ``z = ceil(prod(input_shape) / ratio)``.
    ``model_kwargs`` go to the model class (for example ``hidden`` or ``channels``).
    """
    if name not in MODELS:
        raise BalerInputError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    shape = tuple(int(s) for s in input_shape)
    z = int(latent_dim) if latent_dim is not None else latent_size(math.prod(shape), compression_ratio)
    kwargs = dict(model_kwargs or {})
    model = MODELS[name](shape, z, **kwargs)
    model.build_kwargs = kwargs  # recorded so a compressed file can rebuild the same architecture
    return model.to(resolve_dtype(dtype))
