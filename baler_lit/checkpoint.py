"""A BalerModule checkpoint read for the file tools (``compress``, ``diagnose``, ``compress-many``, the demo) on
the CPU without Lightning: :func:`load_checkpoint` gives a :class:`TrainedModel`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import BalerInputError

if TYPE_CHECKING:
    from .models import BalerAutoencoder
    from .normalization import MinMaxNormalizer


@dataclass
class TrainedModel:
    """What a BalerModule checkpoint holds for the file tools: the model (eval mode, CPU) and its data description."""

    model: BalerAutoencoder
    normalizer: MinMaxNormalizer
    column_names: list[str]
    column_dtypes: list[str]
    hparams: dict[str, Any] = field(default_factory=dict)


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_checkpoint(path: str | Path) -> TrainedModel:
    """Read a BalerModule checkpoint on the CPU without Lightning.

    ``torch.load(weights_only=True)`` (no arbitrary unpickling), the model rebuilt by
    :func:`~baler_lit.models.build_model` from the stored hyper-parameters, the weights loaded strictly, and the
    normaliser, column names and training dtypes taken from the checkpoint's ``baler`` section.

    The hyper-parameters are a trust boundary: the model they describe is first built on the ``meta`` device
    (:func:`~baler_lit.models.build_blueprint`, no memory) and must match the stored weights name for name,
    shape for shape and in kind (real floating point or not; :func:`~baler_lit.models.check_weights_fit`) before
    it is built for real, so the model never holds more values than the weights the file already brought in.
    """
    import numpy as np
    import torch

    from .models import DEFAULT_COMPRESSION_RATIO, build_blueprint, build_model, check_weights_fit
    from .normalization import MinMaxNormalizer

    p = Path(path)
    if not p.is_file():
        raise BalerInputError(f"checkpoint {p} does not exist")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for damaged or foreign files
        raise BalerInputError(f"cannot load checkpoint {p}: {first_line(exc)}") from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise BalerInputError(f"cannot load checkpoint {p}: not a Lightning checkpoint (no state_dict)")
    hp = ckpt.get("hyper_parameters")
    if not isinstance(hp, dict) or "input_shape" not in hp:
        raise BalerInputError(f"cannot load checkpoint {p}: no BalerModule hyper-parameters")
    info = ckpt.get("baler")
    if not isinstance(info, dict):
        raise BalerInputError(f"checkpoint {p} holds no normalisation (train it with BalerDataModule)")
    weights = ckpt["state_dict"].items()
    state = {k.removeprefix("model."): v for k, v in weights if isinstance(k, str) and k.startswith("model.")}
    description = (
        hp.get("model", "AE"),
        hp["input_shape"],
        hp.get("latent_dim"),
        hp.get("compression_ratio", DEFAULT_COMPRESSION_RATIO),
        hp.get("dtype", "float32"),
        hp.get("model_kwargs"),
    )
    try:
        stored_values = sum(v.numel() for v in state.values() if isinstance(v, torch.Tensor))
        check_weights_fit(build_blueprint(*description, stored_values=stored_values).state_dict(), state)
        model = build_model(*description)
        model.load_state_dict(state, strict=True)
        arrays = {k: np.asarray(info[k], dtype=np.float64) for k in ("norm_min", "norm_scale")}
        normalizer = MinMaxNormalizer.from_arrays(arrays)
        names, dtypes = [str(n) for n in info["names"]], [str(d) for d in info["dtypes"]]
    except BalerInputError as exc:
        raise BalerInputError(f"cannot load checkpoint {p}: {exc}") from None
    except (RuntimeError, KeyError, TypeError, ValueError, OverflowError) as exc:
        raise BalerInputError(f"cannot load checkpoint {p}: {first_line(exc)}") from None
    return TrainedModel(model.eval(), normalizer, names, dtypes, dict(hp))



def adopt_training_dtypes(table, training_dtypes: Sequence[str]) -> None:
    """Describe the columns with the checkpoint's training dtypes when the input file states none.

    A plain Baler ``.npz`` (``data`` + ``names``) carries no dtypes; the training file's (stored in the
    checkpoint) then say which columns are integers and how many bytes the original takes, so the same data
    prints the same ratio whether or not its file carries dtype metadata. Dtypes the input file states win.
    """
    if table.dtypes_inferred and len(training_dtypes) == len(table.dtypes):
        table.dtypes = list(training_dtypes)
