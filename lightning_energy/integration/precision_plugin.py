"""A Lightning precision plugin that can change mode between optimizer steps (the modes:
:mod:`lightning_energy.optimize.precision.modes`).

Lightning fixes its precision plugin when the Trainer is built. :class:`SwitchablePrecision` is one plugin
that delegates to Lightning's own plugin of the current mode (:func:`lightning_plugin`): ``Precision`` for
``32-true`` and ``tf32``, ``MixedPrecision`` for ``bf16-mixed``, ``16-mixed`` (holding this plugin's one
gradient scaler, kept while other modes run) and ``16-mixed-noscale`` (float16 autocast, no scaler), and
``DoublePrecision`` for ``64-true``. On top of them it adds what none of them has: the TF32 switches of CUDA,
the count of steps the gradient scaler skips, and skipping an optimizer step with non-finite gradients in
the reduced modes without a scaler. A change of mode requested while gradients are being accumulated waits
until the optimizer step that consumes them, so that gradients of one step are never a mixture of scaled
and unscaled values. Parameters keep their master dtype (float32; float64 for ``64-true``), so the
optimizer's state never changes dtype.

Switching between ``64-true`` and the other modes after setup is refused with an error: it would change
the parameters' dtype under the optimizer's state and DDP's gradient buckets, which are both built for
the dtype present at setup. Use ``64-true`` as a fixed mode from the start of a run.

Two protected parts of Lightning are used, each in one function (checked with Lightning 2.6.6):
:func:`~lightning_energy.integration.lightning_internals.closure_then_pre_step_hooks` and
:func:`~lightning_energy.integration.lightning_internals.optimizer_unscales_inside_step`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any, Callable

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.optim import LBFGS
from typing_extensions import override

from lightning_energy.integration.lightning_internals import closure_then_pre_step_hooks, optimizer_unscales_inside_step
from lightning_energy.optimize.precision.modes import MODE_NAMES, REFERENCE_MODE, PrecisionMode, get_mode, unavailable_reason


class SwitchablePrecision(Precision):
    """A precision plugin whose mode can change between optimizer steps.

    ``Trainer(plugins=[SwitchablePrecision("bf16-mixed")])`` trains in one mode; the ``PrecisionSwitch``
    callback installs one itself when the Trainer has the default precision, and drives it with
    :meth:`request_mode`.

    Args:
        mode: the starting mode, one of :data:`MODE_NAMES`.
        skip_nonfinite_steps: in ``tf32``, ``bf16-mixed`` and ``16-mixed-noscale``, skip the optimizer step
            when a gradient is NaN or infinite (the gradient scaler does this in ``16-mixed``), so that one bad
            step leaves parameters and optimizer state intact and a fallback can carry on from them. Costs one
            pass over the gradients and one host-device synchronisation per optimizer step in those modes;
            ``32-true`` and ``64-true`` never check (they step exactly as Lightning's own plugin does).
        device_type: ``"cpu"`` or ``"cuda"``; None reads it from the model's parameters at setup.

    Attributes:
        check_reference_steps: with ``skip_nonfinite_steps``, ``32-true`` and ``64-true`` steps also run the
            gradient check (the same pass and synchronisation) but never skip: ``PrecisionSwitch`` sets it
            while profiling so that every mode is measured under the same synchronisation regime.
        nonfinite_reference_steps: ``32-true``/``64-true`` steps that check found non-finite (and stepped).
        skipped_steps: optimizer steps skipped because of non-finite gradients (scaler skips included).
        consecutive_skips: skipped steps in a row up to the latest optimizer step, in the current mode.
    """

    def __init__(self, mode: str = REFERENCE_MODE, skip_nonfinite_steps: bool = True,
                 device_type: str | None = None) -> None:
        super().__init__()
        self._mode = get_mode(mode)
        if not isinstance(skip_nonfinite_steps, bool):
            raise TypeError(f"`skip_nonfinite_steps` must be a bool, got {type(skip_nonfinite_steps).__name__}")
        if device_type is not None and not isinstance(device_type, str):
            raise TypeError(f"`device_type` must be a string such as 'cpu' or 'cuda', got {device_type!r}")
        self.skip_nonfinite_steps = skip_nonfinite_steps
        self.device_type = device_type
        self._pending: PrecisionMode | None = None
        self._grads_pending = False  # a backward ran whose gradients no optimizer step has consumed yet
        self._connected_dtype: torch.dtype | None = None  # parameter dtype fixed at setup
        self._scaler: torch.amp.GradScaler | None = None  # kept while in other modes: its state survives
        self._saved_flags: tuple | None = None  # the user's TF32 switches, restored at teardown
        self._delegates: dict[tuple[str, str, bool], Precision] = {}  # Lightning's plugin of each mode, built once
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.check_reference_steps = False
        self.nonfinite_reference_steps = 0

    # ---------------------------------------------------------------- mode
    @property
    def mode(self) -> PrecisionMode:
        return self._mode

    @property
    def mode_name(self) -> str:
        return self._mode.name

    @property
    def pending_mode(self) -> str | None:
        """A requested mode that waits for the current accumulation to reach its optimizer step."""
        return self._pending.name if self._pending is not None else None

    @property
    def precision(self) -> str:  # type: ignore[override]
        """Lightning's precision string for the current mode (``trainer.precision``)."""
        return self._mode.lightning_precision

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The gradient scaler in use now (None in modes without scaling)."""
        return self._scaler if self._mode.grad_scaling else None

    def delegate(self, mode: PrecisionMode | None = None) -> Precision:
        """Lightning's own plugin that runs ``mode`` (default: the current mode) on this device, built once.

        In ``16-mixed`` it holds this plugin's gradient scaler; before the scaler exists (the device is not
        known yet) a ``16-mixed`` step runs as ``16-mixed-noscale`` does."""
        mode = mode or self._mode
        device = self.device_type or "cpu"
        scaler = self._scaler if mode.grad_scaling else None
        key = (mode.name, device, scaler is not None)
        delegate = self._delegates.get(key)
        if delegate is None:
            delegate = self._delegates[key] = lightning_plugin(mode, device, scaler)
        if scaler is not None:
            delegate.scaler = scaler  # the one scaler, whose state every stint in 16-mixed carries on
        return delegate

    def request_mode(self, name: str) -> bool:
        """Switch to mode ``name`` now, or after the next optimizer step if gradients are accumulating.

        Returns True when the mode changed immediately. Raises ``ValueError`` for an unknown mode, for a
        change of parameter dtype after setup (to or from ``64-true``) and for a mode this device lacks.
        """
        mode = get_mode(name)
        if self._connected_dtype is not None and mode.param_dtype != self._connected_dtype:
            raise ValueError(
                f"cannot switch to {name!r}: its parameters are {mode.param_dtype} but the model was set up "
                f"with {self._connected_dtype}; switching to or from '64-true' is only possible before training "
                "starts (use it as a fixed mode)"
            )
        if self.device_type is not None and (reason := unavailable_reason(mode, self.device_type)):
            raise ValueError(f"precision mode {name!r} is not available here: {reason}")
        if self._grads_pending:
            self._pending = mode if mode != self._mode else None
            return False
        self._pending = None
        self._activate(mode)
        return True

    def _activate(self, mode: PrecisionMode) -> None:
        if mode != self._mode:
            self.consecutive_skips = 0
        self._mode = mode
        if mode.grad_scaling and self._scaler is None and self.device_type is not None:
            self._scaler = torch.amp.GradScaler(self.device_type)
        if self._saved_flags is not None:
            self._apply_flags()

    # ---------------------------------------------------------------- TF32 switches (CUDA)
    def _apply_flags(self) -> None:
        if self.device_type != "cuda":
            return
        if self._saved_flags is None:
            self._saved_flags = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
        torch.set_float32_matmul_precision("high" if self._mode.tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = self._mode.tf32

    def _restore_flags(self) -> None:
        if self._saved_flags is not None:
            matmul, cudnn = self._saved_flags
            torch.set_float32_matmul_precision(matmul)
            torch.backends.cudnn.allow_tf32 = cudnn
            self._saved_flags = None

    # ---------------------------------------------------------------- set-up
    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.delegate().convert_module(module)

    @override
    def connect(self, model: torch.nn.Module, optimizers: list, lr_schedulers: list) -> tuple:
        floating = [p for p in model.parameters() if p.is_floating_point()]
        if self.device_type is None:
            self.device_type = floating[0].device.type if floating else "cpu"
        wrong = sorted({str(p.dtype) for p in floating if p.dtype != self._mode.param_dtype})
        if wrong:
            raise ValueError(
                f"precision mode {self._mode.name!r} keeps parameters in {self._mode.param_dtype}, but the model "
                f"has parameters in {', '.join(wrong)}; build the model in {self._mode.param_dtype} (for float64 "
                "use the '64-true' mode)"
            )
        if reason := unavailable_reason(self._mode, self.device_type):
            raise ValueError(f"precision mode {self._mode.name!r} is not available here: {reason}")
        self._connected_dtype = self._mode.param_dtype
        self._activate(self._mode)  # creates the scaler of a scaled starting mode
        self._apply_flags()
        return model, optimizers, lr_schedulers

    @override
    def teardown(self) -> None:
        self._restore_flags()
        self.check_reference_steps = False
        self._connected_dtype = None
        self._grads_pending = False
        if self._pending is not None:
            self._activate(self._pending)
            self._pending = None

    # ---------------------------------------------------------------- forward
    @override
    def convert_input(self, data: Any) -> Any:
        return self.delegate().convert_input(data)

    @override
    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return self.delegate().tensor_init_context()

    @override
    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.delegate().module_init_context()

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self.mode_context(self._mode):
            yield

    @contextlib.contextmanager
    def mode_context(self, mode: PrecisionMode) -> Generator[None, None, None]:
        """The forward-pass context of ``mode``: its Lightning plugin's (autocast, float64 default dtype) and
        its TF32 switches (restored on exit)."""
        if self._saved_flags is None and self.device_type == "cuda":
            self._apply_flags()  # a new stage after teardown
        swap_flags = self.device_type == "cuda" and mode.tf32 != self._mode.tf32
        if swap_flags:
            torch.set_float32_matmul_precision("high" if mode.tf32 else "highest")
            torch.backends.cudnn.allow_tf32 = mode.tf32
        try:
            with self.delegate(mode).forward_context():
                yield
        finally:
            if swap_flags:
                self._apply_flags()

    # ---------------------------------------------------------------- backward and optimizer step
    @override
    def pre_backward(self, tensor: Tensor, module) -> Tensor:  # type: ignore[override]
        self._grads_pending = True
        return self.delegate().pre_backward(tensor, module)  # 16-mixed: scaled by the scaler

    @override
    def backward(self, tensor: Tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.delegate().backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module) -> Tensor:  # type: ignore[override]
        return self.delegate().post_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer, model, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        delegate = self.delegate()
        try:
            if self.scaler is not None:
                return self._scaled_step(delegate, optimizer, model, closure, **kwargs)
            if not (self.skip_nonfinite_steps and self._mode.reduced) or isinstance(optimizer, LBFGS):
                if self.check_reference_steps and self.skip_nonfinite_steps and not isinstance(optimizer, LBFGS):
                    closure = self._checking_closure(optimizer, closure)
                return delegate.optimizer_step(optimizer, model=model, closure=closure, **kwargs)
            return self._checked_step(optimizer, model, closure, **kwargs)
        finally:
            self._grads_pending = False
            if self._pending is not None:
                pending, self._pending = self._pending, None
                self._activate(pending)

    def _scaled_step(self, delegate: MixedPrecision, optimizer, model, closure: Callable[[], Any],
                     **kwargs: Any) -> Any:
        """``MixedPrecision.optimizer_step`` (unscale once, clip, the scaler's step and update), counting the
        steps the scaler skips."""
        if isinstance(optimizer, LBFGS):
            raise ValueError("gradient scaling ('16-mixed') does not work with the LBFGS optimizer")
        scaler = delegate.scaler
        results: list[Any] = []

        def recorded() -> Any:
            results.append(closure())
            return results[-1]

        def backward_ran() -> bool:  # else Lightning's plugin returns before the scaler's step and update
            return bool(results) and not (results[0] is None and model.automatic_optimization)

        if optimizer_unscales_inside_step(optimizer) or not isinstance(optimizer, torch.optim.Optimizer):
            # the optimizer's step runs (and skips inside) in any case: the scale backs off iff it skipped
            scale_before = scaler.get_scale()  # two extra host-device synchronisations
            step_output = delegate.optimizer_step(optimizer, model=model, closure=recorded, **kwargs)
            if backward_ran():
                self._count_step(skipped=scaler.get_scale() < scale_before)
            return step_output
        stepped: list[bool] = []  # the scaler calls optimizer.step only on finite gradients: no extra sync
        handle = optimizer.register_step_post_hook(lambda *_: stepped.append(True))
        try:
            step_output = delegate.optimizer_step(optimizer, model=model, closure=recorded, **kwargs)
        finally:
            handle.remove()
        if backward_ran():
            self._count_step(skipped=not stepped)
        return step_output

    def _checked_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """The step of a reduced mode without a scaler: skipped when a gradient is not finite (no Lightning
        plugin skips: theirs run the closure inside ``optimizer.step``, which cannot be called off then)."""
        closure_result = closure_then_pre_step_hooks(self.delegate(), model, optimizer, closure)
        if closure_result is None and model.automatic_optimization:
            return closure_result  # backward was skipped
        if not gradients_finite(optimizer):
            self._count_step(skipped=True)
            return closure_result
        self._count_step(skipped=False)
        return optimizer.step(**kwargs)

    def _checking_closure(self, optimizer, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` followed by the reduced modes' gradient check, whose verdict is only counted: the
        full-precision step pays the same pass and synchronisation, and steps exactly as without it."""
        def checked() -> Any:
            result = closure()
            if not gradients_finite(optimizer):
                self.nonfinite_reference_steps += 1
            return result

        return checked

    def _count_step(self, skipped: bool) -> None:
        if skipped:
            self.skipped_steps += 1
            self.consecutive_skips += 1
        else:
            self.consecutive_skips = 0

    @override
    def clip_gradients(self, optimizer, clip_val=0.0,  # type: ignore[override]
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if self.scaler is not None:  # MixedPrecision refuses to clip for an optimizer that unscales inside
            self.delegate().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
        else:  # unscaled gradients clip with any optimizer (MixedPrecision('bf16-mixed') would refuse a fused one)
            super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    # ---------------------------------------------------------------- checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": (self._pending or self._mode).name,
            "scaler": self._scaler.state_dict() if self._scaler is not None else None,
            "skipped_steps": self.skipped_steps,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mode = get_mode(state_dict.get("mode"), "checkpoint's precision mode")
        if state_dict.get("scaler") is not None:
            if self._scaler is None:
                self._scaler = torch.amp.GradScaler(self.device_type or "cpu")
            self._scaler.load_state_dict(state_dict["scaler"])
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.request_mode(mode.name)


def gradients_finite(optimizer) -> bool:
    """True if every gradient of ``optimizer``'s parameters is finite (one host-device synchronisation)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return True
    if bool(torch.isfinite(torch.nn.utils.get_total_norm(grads))):
        return True
    # the norm overflows for huge finite values too: look at the elements before calling it non-finite
    return all(bool(torch.isfinite(g).all()) for g in grads)


def lightning_plugin(mode: PrecisionMode, device_type: str, scaler: torch.amp.GradScaler | None = None) -> Precision:
    """Lightning's own precision plugin that runs ``mode`` on ``device_type``: the autocast context, the
    gradient scaling (with ``scaler`` in ``16-mixed``), the float64 conversion of ``64-true``. TF32 has no
    Lightning plugin: ``tf32`` is ``Precision`` plus switches the caller sets."""
    if mode.param_dtype == torch.float64:
        return DoublePrecision()
    if mode.autocast_dtype is None:
        return Precision()
    precision = "bf16-mixed" if mode.autocast_dtype == torch.bfloat16 else "16-mixed"
    if scaler is not None:
        return MixedPrecision(precision, device_type, scaler=scaler)
    plugin = MixedPrecision(precision, device_type)
    plugin.scaler = None  # float16 without scaling: MixedPrecision builds a scaler for '16-mixed'; not used here
    return plugin
