"""Baler's autoencoders, with every layer size derived from the data shape.

Every model shares one interface (:class:`BalerAutoencoder`): ``encoder`` and ``decoder`` sub-modules,
``encode(x) -> z``, ``decode(z) -> x_hat`` and ``forward(x) -> x_hat``. Inputs are min-max normalised
values (dimensionless, nominally in [0, 1]); ``z`` has ``latent_dim`` features per sample.

- :class:`AE`: Baler's ``AE`` — encoder n→200→100→50→z, decoder z→50→100→200→n, LeakyReLU (slope 0.01)
  between layers, no activation on ``z`` or on the output. Tables only.
- :class:`CFD_dense_AE`: Baler's ``CFD_dense_AE`` — the same dense stack on 2-D frames: frames in, frames out
  (each frame is flattened inside the model, n = H·W), so a user never flattens by hand.
- :class:`AE_Dropout_BN`: Baler's ``AE_Dropout_BN`` — same sizes, dropout 0.5/0.4/0.3/0.2 in the encoder,
  BatchNorm in the decoder, ReLU on the output (as in the original).
- :class:`ConvAE`: a convolutional autoencoder for 2-D frames (for example Baler's 50×50 CFD frames).
  Unlike the original conv AEs, which hard-code a flattened size, the flattened size and the transposed
  convolutions' output padding are computed from the frame shape, so any H×W works.
- :class:`PJ_Conv_AE`: Baler's ``PJ_Conv_AE`` (two 5×5 stride-2 convolutions, a 500-unit dense bottleneck, two
  transposed convolutions), with the flattened size and output paddings computed from the frame shape (the
  original hard-codes 28×28 frames).
- :class:`Conv_AE`: Baler's ``Conv_AE`` (three stride-1 convolutions, kernels (2,5)/3/3, a 2000-unit dense
  bottleneck, BatchNorm in the decoder), sized from the frame shape: the original hard-codes a flattened size of
  128 and fails on any other frame (50×50 CFD frames among them).
- :class:`Conv_AE_GDN`: Baler's ``Conv_AE_GDN``: ``Conv_AE``'s layers with generalised divisive normalisation
  (:class:`GDN`, inverse GDN in the decoder) in place of the convolutions' ReLUs.
- :class:`Conv_AE_3D`: Baler's ``Conv_AE_3D``: 3-D convolutions over a block of ``depth`` consecutive frames.
  A sample is the block's frames stacked row-wise, ``(depth·H, W)`` (what Baler's ``convert_to_blocks`` makes of
  frame data), sized from it (the original hard-codes 15 frames of 50×50 and takes its batch as the depth).
- :class:`FPGA_prototype_model`: Baler's small dense model for the hls4ml FPGA export, n→20→10→z→10→20→n with
  ReLU (each activation a layer of its own, as hls4ml needs).
- :class:`TransformerAE`: a transformer autoencoder in the spirit of Baler's ``TransformerAE`` (whose constructor
  does not accept Baler's ``n_features``/``z_dim`` arguments, and which attends across the rows of a batch, so a
  row's code would depend on its neighbours). Here each sample is a sequence of tokens — one per column of a
  table row, one per row of a frame — so a code depends on its own sample only.

:func:`build_model` creates a model by name from JSON-friendly arguments, so a compressed file can rebuild
its decoder without unpickling anything. Every class in :data:`MODELS` names a small ``example`` (sample shape and
arguments) that the tests build, train, compress and decompress, so a model added to the registry is tested
without a test of its own.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sequence
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
    #: a small sample shape and constructor arguments this model accepts (the registry's tests use them)
    example: tuple[tuple[int, ...], dict[str, Any]] = ((8,), {})

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
    """``n_columns`` of table rows; frames are refused with a pointer to the models that take them."""
    if len(input_shape) != 1:
        raise BalerInputError(
            f"model {name} needs table rows (input_shape = (n_columns,)), got input_shape {tuple(input_shape)};"
            " use CFD_dense_AE, ConvAE or PJ_Conv_AE for 2-D frames"
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
        n = self._n_inputs()
        hidden = [int(h) for h in hidden]
        self.encoder = _dense_stack([n, *hidden, self.latent_dim], negative_slope)
        self.decoder = _dense_stack([self.latent_dim, *reversed(hidden), n], negative_slope)

    def _n_inputs(self) -> int:
        return _require_table(type(self).__name__, self.input_shape)


class CFD_dense_AE(AE):  # noqa: N801 - Baler's class name
    example = ((6, 5), {})
    """Baler's ``CFD_dense_AE``: :class:`AE`'s dense stack on frames ``(H, W)`` (or any sample shape).

    ``encode`` flattens each sample to ``n = prod(input_shape)`` values, ``decode`` restores the sample shape,
    so the model takes and returns frames. The layer sizes are the original's (n→200→100→50→z and back).
    """

    def _n_inputs(self) -> int:
        return self.n_features

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x.flatten(1))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z).unflatten(1, self.input_shape)


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


def _frame_layout(name: str, input_shape: tuple[int, ...]) -> tuple[int, int, int, bool]:
    """``(channels, H, W, add_channel)`` of frames ``(H, W)`` or ``(C, H, W)``; tables are refused."""
    if len(input_shape) == 2:
        return 1, input_shape[0], input_shape[1], True
    if len(input_shape) == 3:
        return input_shape[0], input_shape[1], input_shape[2], False
    raise BalerInputError(
        f"{name} needs frames (input_shape (H, W) or (C, H, W)), got input_shape {input_shape};"
        " use AE or TransformerAE for table rows"
    )


def _transposed_padding(size_in: tuple[int, int], size_out: tuple[int, int], stride: int, kernel: int, padding: int):
    """``output_padding`` that makes a transposed convolution map ``size_in`` exactly to ``size_out``."""
    return tuple(o - ((i - 1) * stride - 2 * padding + kernel) for i, o in zip(size_in, size_out))


class _FrameAE(BalerAutoencoder):
    """Convolutional models: ``(H, W)`` frames get a channel axis on the way in and lose it on the way out."""

    _add_channel = False

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x.unsqueeze(1) if self._add_channel else x)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        out = self.decoder(z)
        return out.squeeze(1) if self._add_channel else out


class ConvAE(_FrameAE):
    example = ((8, 8), {"channels": [4, 4]})
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
        in_ch, height, width, self._add_channel = _frame_layout("ConvAE", self.input_shape)
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


#: ``PJ_Conv_AE``'s sizes (the original's): channels of its two convolutions, kernel, stride, padding, the dense
#: bottleneck width and the LeakyReLU slope.
PJ_CHANNELS = (20, 50)
PJ_KERNEL, PJ_STRIDE, PJ_PADDING = 5, 2, 2
PJ_HIDDEN = 500
PJ_SLOPE = 0.2


def _pj_out(size: int) -> int:
    """Output length of PJ_Conv_AE's kernel-5, stride-2, padding-2 convolution."""
    return (size + 2 * PJ_PADDING - PJ_KERNEL) // PJ_STRIDE + 1


class PJ_Conv_AE(_FrameAE):  # noqa: N801 - Baler's class name
    example = ((8, 8), {"hidden": 16})
    """Baler's ``PJ_Conv_AE`` sized from the frame shape.

    Encoder: Conv(C→20, 5×5, stride 2) → LeakyReLU(0.2) → Conv(20→50, 5×5, stride 2) → flatten → Linear(→500) →
    Linear(500→z). Decoder: Linear(z→500) → LeakyReLU(0.2) → Linear(500→flat) → unflatten → ConvT(50→20) →
    ConvT(20→C) → LeakyReLU(0.2), as the original. The flattened size (50·h·w) and the transposed convolutions'
    output padding follow from H×W (28×28 → 7×7 as in the original; 50×50 → 13×13).
    """

    def __init__(self, input_shape: Sequence[int], latent_dim: int, hidden: int = PJ_HIDDEN) -> None:
        super().__init__(input_shape, latent_dim)
        in_ch, height, width, self._add_channel = _frame_layout("PJ_Conv_AE", self.input_shape)
        c1, c2 = PJ_CHANNELS
        sizes = [(height, width)]
        for _ in range(2):
            sizes.append((_pj_out(sizes[-1][0]), _pj_out(sizes[-1][1])))
        flat = c2 * sizes[-1][0] * sizes[-1][1]
        conv = {"kernel_size": PJ_KERNEL, "stride": PJ_STRIDE, "padding": PJ_PADDING}
        self.encoder = nn.Sequential(
            nn.Conv2d(in_ch, c1, **conv),
            nn.LeakyReLU(PJ_SLOPE),
            nn.Conv2d(c1, c2, **conv),
            nn.Flatten(1),
            nn.Linear(flat, int(hidden)),
            nn.Linear(int(hidden), self.latent_dim),
        )
        pad = [_transposed_padding(sizes[i + 1], sizes[i], PJ_STRIDE, PJ_KERNEL, PJ_PADDING) for i in range(2)]
        self.decoder = nn.Sequential(
            nn.Linear(self.latent_dim, int(hidden)),
            nn.LeakyReLU(PJ_SLOPE),
            nn.Linear(int(hidden), flat),
            nn.Unflatten(1, (c2, *sizes[-1])),
            nn.ConvTranspose2d(c2, c1, output_padding=pad[1], **conv),
            nn.ConvTranspose2d(c1, in_ch, output_padding=pad[0], **conv),
            nn.LeakyReLU(PJ_SLOPE),
        )
        self.flat_size = flat


class _TokenEncoder(nn.Module):
    """Pre-norm transformer encoder layers over ``(batch, tokens, d_model)`` (no nested-tensor fast path)."""

    def __init__(self, d_model: int, n_heads: int, n_layers: int, feedforward: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model, n_heads, feedforward, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
            )
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class _TransformerEncoderPart(nn.Module):
    def __init__(self, n_tokens: int, token_size: int, latent_dim: int, d_model: int, blocks: _TokenEncoder) -> None:
        super().__init__()
        self.embed = nn.Linear(token_size, d_model)
        self.position = nn.Parameter(torch.zeros(n_tokens, d_model))
        nn.init.normal_(self.position, std=0.02)
        self.blocks = blocks
        self.to_latent = nn.Linear(n_tokens * d_model, latent_dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.embed(tokens) + self.position)
        return self.to_latent(h.flatten(1))


class _TransformerDecoderPart(nn.Module):
    def __init__(self, n_tokens: int, token_size: int, latent_dim: int, d_model: int, blocks: _TokenEncoder) -> None:
        super().__init__()
        self.from_latent = nn.Linear(latent_dim, n_tokens * d_model)
        self.position = nn.Parameter(torch.zeros(n_tokens, d_model))
        nn.init.normal_(self.position, std=0.02)
        self.blocks = blocks
        self.unembed = nn.Linear(d_model, token_size)
        self.n_tokens, self.d_model = n_tokens, d_model

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.from_latent(z).unflatten(1, (self.n_tokens, self.d_model)) + self.position
        return self.unembed(self.blocks(h))


class TransformerAE(BalerAutoencoder):
    example = ((6,), {"d_model": 8, "n_heads": 2, "n_layers": 1, "feedforward": 16})
    """Transformer autoencoder; each sample is a sequence of tokens.

    Tokens: one per column of a table row (token size 1), one per row of an ``(H, W)`` frame (token size W), one
    per channel-row of a ``(C, H, W)`` frame. Encoder: Linear(token→d_model) + learned position → ``n_layers``
    pre-norm transformer layers (GELU, as the original) → flatten → Linear(→z). The decoder mirrors it:
    Linear(z→tokens·d_model) + position → transformer layers → Linear(d_model→token). Attention runs within a
    sample, so a sample's code never depends on the other rows of its batch.
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        latent_dim: int,
        d_model: int = 32,
        n_heads: int = 4,
        n_layers: int = 2,
        feedforward: int = 64,
    ) -> None:
        super().__init__(input_shape, latent_dim)
        if d_model < 1 or n_heads < 1 or d_model % n_heads:
            raise BalerInputError(f"TransformerAE needs d_model divisible by n_heads, got {d_model} and {n_heads}")
        if n_layers < 1 or feedforward < 1:
            raise BalerInputError(f"TransformerAE needs n_layers >= 1 and feedforward >= 1, got {n_layers}, {feedforward}")
        if len(self.input_shape) == 1:
            self.n_tokens, self.token_size = self.input_shape[0], 1
        else:
            self.n_tokens = math.prod(self.input_shape[:-1])
            self.token_size = self.input_shape[-1]
        args = (self.n_tokens, self.token_size, self.latent_dim, int(d_model))
        self.encoder = _TransformerEncoderPart(*args, _TokenEncoder(d_model, n_heads, n_layers, feedforward))
        self.decoder = _TransformerDecoderPart(*args, _TokenEncoder(d_model, n_heads, n_layers, feedforward))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x.reshape(x.shape[0], self.n_tokens, self.token_size))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z).reshape(z.shape[0], *self.input_shape)


#: Baler's ``Conv_AE`` / ``Conv_AE_GDN`` sizes: channels of the three convolutions, the first kernel, the dense
#: bottleneck width.
BALER_CONV_CHANNELS = (8, 16, 32)
BALER_CONV_FIRST_KERNEL = (2, 5)
BALER_CONV_MID = 2000
#: ``FPGA_prototype_model``'s hidden widths (encoder side).
FPGA_HIDDEN = (20, 10)


class FPGA_prototype_model(BalerAutoencoder):  # noqa: N801 - Baler's class name
    """Baler's ``FPGA_prototype_model``: encoder n→20→10→z, decoder z→10→20→n, ReLU between layers (a layer
    each, not a function, so hls4ml can convert the model), no activation on ``z`` or on the output. Tables."""

    def __init__(self, input_shape: Sequence[int], latent_dim: int, hidden: Sequence[int] = FPGA_HIDDEN) -> None:
        super().__init__(input_shape, latent_dim)
        n = _require_table("FPGA_prototype_model", self.input_shape)
        hidden = [int(h) for h in hidden]
        self.encoder = _relu_stack([n, *hidden, self.latent_dim])
        self.decoder = _relu_stack([self.latent_dim, *reversed(hidden), n])


def _relu_stack(sizes: Sequence[int]) -> nn.Sequential:
    """Linear layers through ``sizes`` with a ReLU layer between them and none after the last one."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class _LowerBound(torch.autograd.Function):
    """``max(x, bound)`` whose gradient still flows where ``x`` is below the bound but the step would raise it
    (Ballé's reparametrised GDN; Baler's ``LowerBound``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bound: float) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.bound = bound
        return x.clamp_min(bound)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        return grad * ((x >= ctx.bound) | (grad < 0)).to(grad.dtype), None


class GDN(nn.Module):
    """Generalised divisive normalisation over the channels of ``(B, C, H, W)``:
    ``y_i = x_i / sqrt(beta_i + Σ_j gamma_ij · x_j²)`` (``inverse``: ``x_i · sqrt(...)``), Baler's ``GDN``.

    ``beta`` and ``gamma`` are stored reparametrised (squared, with a small pedestal, and kept above a floor) as
    in the original: ``beta`` starts at 1, ``gamma`` at ``gamma_init`` times the identity.
    """

    def __init__(self, channels: int, inverse: bool = False, beta_min: float = 1e-6, gamma_init: float = 0.1,
                 reparam_offset: float = 2**-18) -> None:  # fmt: skip
        super().__init__()
        self.inverse = bool(inverse)
        self.pedestal = reparam_offset**2
        self.beta_bound = (beta_min + self.pedestal) ** 0.5
        self.gamma_bound = reparam_offset
        self.beta = nn.Parameter(torch.sqrt(torch.ones(channels) + self.pedestal))
        self.gamma = nn.Parameter(torch.sqrt(gamma_init * torch.eye(channels) + self.pedestal))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        beta = _LowerBound.apply(self.beta, self.beta_bound) ** 2 - self.pedestal
        gamma = _LowerBound.apply(self.gamma, self.gamma_bound) ** 2 - self.pedestal
        norm = torch.sqrt(nn.functional.conv2d(x * x, gamma.view(channels, channels, 1, 1), beta))
        return x * norm if self.inverse else x / norm


class _BalerConv2d(_FrameAE):
    """``Conv_AE``'s layout; ``_act(channels, inverse)`` is the activation after each convolution."""

    _name = "Conv_AE"
    _encoder_norm = True  # BatchNorm after the second convolution

    def _act(self, channels: int, inverse: bool) -> nn.Module:
        return nn.ReLU()

    def __init__(self, input_shape: Sequence[int], latent_dim: int, mid: int = BALER_CONV_MID) -> None:
        super().__init__(input_shape, latent_dim)
        in_ch, height, width, self._add_channel = _frame_layout(self._name, self.input_shape)
        if height < 2 or width < 5:
            raise BalerInputError(f"{self._name} needs frames of at least 2×5, got {height}×{width}")
        c1, c2, c3 = BALER_CONV_CHANNELS
        conv_h, conv_w = height - 1, width - 4  # kernel (2,5) pad 1, kernel 3 pad 1, kernel 3 pad 0
        flat = c3 * conv_h * conv_w
        mid = int(mid)
        enc: list[nn.Module] = [nn.Conv2d(in_ch, c1, BALER_CONV_FIRST_KERNEL, padding=1), self._act(c1, False),
                                nn.Conv2d(c1, c2, 3, padding=1)]  # fmt: skip
        if self._encoder_norm:
            enc.append(nn.BatchNorm2d(c2))
        enc += [self._act(c2, False), nn.Conv2d(c2, c3, 3, padding=0), self._act(c3, False), nn.Flatten(1),
                nn.Linear(flat, mid), nn.ReLU(), nn.Linear(mid, self.latent_dim), nn.ReLU()]  # fmt: skip
        self.encoder = nn.Sequential(*enc)
        self.decoder = nn.Sequential(
            nn.Linear(self.latent_dim, mid), nn.ReLU(), nn.Linear(mid, flat), nn.ReLU(),
            nn.Unflatten(1, (c3, conv_h, conv_w)),
            nn.ConvTranspose2d(c3, c2, 3, padding=0), *self._decoder_act(c2),
            nn.ConvTranspose2d(c2, c1, 3, padding=1), *self._decoder_act(c1),
            nn.ConvTranspose2d(c1, in_ch, BALER_CONV_FIRST_KERNEL, padding=1),
        )  # fmt: skip
        self.flat_size = flat

    def _decoder_act(self, channels: int) -> list[nn.Module]:
        return [nn.BatchNorm2d(channels), nn.ReLU()]


class Conv_AE(_BalerConv2d):  # noqa: N801 - Baler's class name
    """Baler's ``Conv_AE`` on frames ``(H, W)`` or ``(C, H, W)`` (at least 2×5).

    Encoder: Conv(C→8, 2×5, pad 1) → ReLU → Conv(8→16, 3×3, pad 1) → BatchNorm → ReLU → Conv(16→32, 3×3) → ReLU →
    flatten → Linear(→``mid``) → ReLU → Linear(→z) → ReLU. Decoder: Linear(z→mid) → ReLU → Linear(→flat) → ReLU →
    unflatten → ConvT(32→16, 3×3) → BatchNorm → ReLU → ConvT(16→8, 3×3, pad 1) → BatchNorm → ReLU →
    ConvT(8→C, 2×5, pad 1). All strides 1: the convolutions give (H−1)×(W−4) and the transposed ones undo it
    exactly, so the flattened size is 32·(H−1)·(W−4), which the original hard-codes to 128. ``mid`` (Baler: 2000)
    sets the dense width: on 50×50 frames the first dense layer holds 32·49·46·2000 ≈ 144 M weights.
    """

    example = ((4, 8), {"mid": 16})


class Conv_AE_GDN(_BalerConv2d):  # noqa: N801 - Baler's class name
    """Baler's ``Conv_AE_GDN``: :class:`Conv_AE` with :class:`GDN` after each convolution instead of ReLU
    (BatchNorm kept after the second), inverse GDN after the decoder's first two transposed convolutions (no
    BatchNorm there), as the original."""

    example = ((4, 8), {"mid": 16})
    _name = "Conv_AE_GDN"

    def _act(self, channels: int, inverse: bool) -> nn.Module:
        return GDN(channels, inverse=inverse)

    def _decoder_act(self, channels: int) -> list[nn.Module]:
        return [GDN(channels, inverse=True)]


#: ``Conv_AE_3D``'s channels and kernels (the original's), encoder side; the decoder mirrors them.
CONV3D_LAYERS = ((4, (1, 3, 5)), (8, (3, 3, 3)), (16, (3, 3, 3)), (32, (3, 3, 3)), (64, (3, 3, 3)), (64, (1, 3, 3)))
#: the original's block depth (15 frames of 50×50 give its hard-coded 64·7·38·36 = 612,864 flattened values)
CONV3D_DEPTH = 15


class Conv_AE_3D(BalerAutoencoder):  # noqa: N801 - Baler's class name
    """Baler's ``Conv_AE_3D``: 3-D convolutions over a block of ``depth`` consecutive frames.

    A sample is the block's frames stacked row-wise, shape ``(depth·H, W)`` (Baler's ``convert_to_blocks`` with
    blocks ``[_, depth·H, W]`` makes it from frame data); the model views it as a ``depth × H × W`` volume. Encoder:
    six Conv3d (channels 4, 8, 16, 32, 64, 64; kernels 1×3×5, four 3×3×3, 1×3×3; stride 1, no padding) each followed
    by ReLU, flatten, Linear(→``mid``) → ReLU → Linear(→z) → ReLU. Decoder: Linear(z→mid) → ReLU → Linear(→flat) →
    ReLU → the transposed convolutions in reverse, each but the last followed by BatchNorm3d and ReLU. The volume
    shrinks to (depth−8)×(H−12)×(W−14), so blocks of at least 9 frames of 13×15 are needed.
    ``compress_to_latent_space=False`` (Baler's option) skips the dense layers: the latent code is the flattened
    convolution output and ``latent_dim`` becomes its size.
    """

    example = ((9 * 13, 15), {"depth": 9, "mid": 16})

    def __init__(self, input_shape: Sequence[int], latent_dim: int, depth: int = CONV3D_DEPTH, mid: int = BALER_CONV_MID,
                 compress_to_latent_space: bool = True) -> None:  # fmt: skip
        super().__init__(input_shape, latent_dim)
        depth = int(depth)
        if len(self.input_shape) != 2 or depth < 1 or self.input_shape[0] % depth:
            raise BalerInputError(
                f"Conv_AE_3D needs stacked frames (depth·H, W) with depth {depth} dividing the rows, got input_shape"
                f" {self.input_shape}; convert_to_blocks [_, depth·H, W] stacks frame data that way"
            )
        volume = (depth, self.input_shape[0] // depth, self.input_shape[1])
        out = list(volume)
        for _, kernel in CONV3D_LAYERS:
            out = [o - k + 1 for o, k in zip(out, kernel)]
        if min(out) < 1:
            raise BalerInputError(f"Conv_AE_3D needs blocks of at least 9 frames of 13×15, got {volume}")
        flat = CONV3D_LAYERS[-1][0] * math.prod(out)
        self.volume, self.depth, self.flat_size = volume, depth, flat
        self.compress_to_latent_space = bool(compress_to_latent_space)
        if not self.compress_to_latent_space:
            self.latent_dim = flat
        mid = int(mid)
        enc: list[nn.Module] = []
        prev = 1
        for channels, kernel in CONV3D_LAYERS:
            enc += [nn.Conv3d(prev, channels, kernel), nn.ReLU()]
            prev = channels
        enc.append(nn.Flatten(1))
        dec: list[nn.Module] = []
        if self.compress_to_latent_space:
            enc += [nn.Linear(flat, mid), nn.ReLU(), nn.Linear(mid, self.latent_dim), nn.ReLU()]
            dec += [nn.Linear(self.latent_dim, mid), nn.ReLU(), nn.Linear(mid, flat), nn.ReLU()]
        dec.append(nn.Unflatten(1, (prev, *out)))
        outs = [c for c, _ in CONV3D_LAYERS[-2::-1]] + [1]
        for (_, kernel), channels in zip(CONV3D_LAYERS[::-1], outs):
            dec.append(nn.ConvTranspose3d(prev, channels, kernel))
            if channels != 1:
                dec += [nn.BatchNorm3d(channels), nn.ReLU()]
            prev = channels
        self.encoder = nn.Sequential(*enc)
        self.decoder = nn.Sequential(*dec)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x.reshape(x.shape[0], 1, *self.volume))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z).reshape(z.shape[0], *self.input_shape)


MODELS: dict[str, type[BalerAutoencoder]] = {
    "AE": AE,
    "AE_Dropout_BN": AE_Dropout_BN,
    "CFD_dense_AE": CFD_dense_AE,
    "ConvAE": ConvAE,
    "PJ_Conv_AE": PJ_Conv_AE,
    "TransformerAE": TransformerAE,
    "Conv_AE": Conv_AE,
    "Conv_AE_GDN": Conv_AE_GDN,
    "Conv_AE_3D": Conv_AE_3D,
    "FPGA_prototype_model": FPGA_prototype_model,
}


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


def _declared_sizes(value: Any) -> Iterator[float]:
    """Every number in a model description (nested lists and dicts), and the length of every list in it."""
    if isinstance(value, bool):
        return
    if isinstance(value, numbers.Real):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _declared_sizes(item)
    elif isinstance(value, list | tuple):
        yield len(value)
        for item in value:
            yield from _declared_sizes(item)


def build_blueprint(
    name: str,
    input_shape: Sequence[int],
    latent_dim: int | None = None,
    compression_ratio: float = DEFAULT_COMPRESSION_RATIO,
    dtype: str | torch.dtype = "float32",
    model_kwargs: dict[str, Any] | None = None,
    *,
    stored_values: int,
) -> BalerAutoencoder:
    """:func:`build_model` on PyTorch's ``meta`` device (shapes and dtypes only, no memory), for a model that a
    file describes and whose weights hold ``stored_values`` numbers.

    Every width, layer count, channel count and sample size of a model has at least one weight value of its own,
    so a description that declares a number (or a list) larger than ``stored_values`` is refused before anything
    is built: building even on ``meta`` takes time and memory per layer. Compare the blueprint's ``state_dict``
    with the stored weights (:func:`check_weights_fit`) before building the model for real.
    """
    described = [input_shape, latent_dim, model_kwargs]
    largest = max(_declared_sizes(described), default=0)
    if not largest <= stored_values:  # also NaN
        raise BalerInputError(
            f"the model description declares a size of {largest}, more than the {stored_values} values its weights"
            " hold"
        )
    with torch.device("meta"):
        return build_model(name, input_shape, latent_dim, compression_ratio, dtype, model_kwargs)


def check_weights_fit(expected: dict[str, torch.Tensor], stored: dict[str, Any]) -> None:
    """Raise :class:`BalerInputError` unless ``stored`` has the tensors of ``expected`` (a blueprint's
    ``state_dict``), name for name, shape for shape, and real floating point where the model's tensor is (and
    not where it is not). The floating dtypes may differ (a checkpoint of a ``64-true`` or ``bf16-true`` run):
    ``load_state_dict`` casts into the model's own dtype, which costs no memory beyond it."""
    if set(expected) != set(stored):
        missing, extra = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
        raise BalerInputError(
            f"the weights do not fit the model description (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    for key, want in expected.items():
        have = stored[key]
        if (
            not isinstance(have, torch.Tensor) or have.shape != want.shape
            or have.is_floating_point() != want.is_floating_point()
        ):  # fmt: skip
            found = f"{have.dtype} {tuple(have.shape)}" if isinstance(have, torch.Tensor) else type(have).__name__
            raise BalerInputError(
                f"weight {key!r} is {found}, the model description needs {want.dtype} {tuple(want.shape)}"
            )
