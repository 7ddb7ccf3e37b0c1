"""Parameters, MACs and FLOPs per layer of a model for one batch.

FLOPs come from ``torch.utils.flop_counter.FlopCounterMode(display=False)``: matrix products,
convolutions and attention count 2 FLOPs per multiply-accumulate; bias additions, activations,
normalisation, losses and optimiser updates count 0. Hence ``forward_MACs = forward_FLOPs / 2``.
Backward FLOPs of a module are its FLOPs over forward + backward minus those of the forward (torch's
formula for a grouped convolution's weight gradient leaves the groups out: ``groups`` times too many).

``study_MACs`` reproduces the MAC table of the Baler profiling study (MACs of one forward pass of the
whole batch, bias additions included). Its figures follow the convention of ptflops
(sovrasov/flops-counter.pytorch, ``pytorch_ops.py``), which the numbers pin down exactly:

- ``Linear``: ``numel(input) x out_features + out_features`` -- the bias is counted ONCE per output
  feature, not once per sample. Baler's AE at batch 512: 512 x 24 x 200 + 200 = 2,457,800;
  512 x 200 x 100 + 100 = 10,240,100; ...; 512 x 200 x 24 + 24 = 2,457,624; total 31,283,939.
- ``Conv1d/2d/3d``: ``N x prod(out spatial) x prod(kernel) x C_in/groups x C_out`` plus, with a bias,
  ``C_out x N x prod(out spatial)`` (ptflops counts the conv bias per output element).
- every other layer: 0 (the study's table lists the Linear layers only).
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_energy.integration.lightning_internals import first_batch_size

ROOT_ROW = "(model)"  # the name of a model that is itself a single layer
OTHER_ROW = "(other ops)"  # FLOPs outside any leaf module: functional calls, losses, non-leaf parameters
STUDY_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass
class LayerCount:
    """One layer's counts for one batch (forward pass of the whole batch; backward likewise)."""

    name: str
    kind: str
    params: int = 0
    forward_FLOPs: int = 0
    backward_FLOPs: int = 0
    study_MACs: int = 0
    calls: int = 0
    bias: bool = False
    input_shape: tuple = ()
    output_shape: tuple = ()
    dtype: str = ""

    @property
    def forward_MACs(self) -> int:
        return self.forward_FLOPs // 2

    @property
    def train_FLOPs(self) -> int:
        """Forward plus backward FLOPs."""
        return self.forward_FLOPs + self.backward_FLOPs


@dataclass
class FlopsTable:
    """Per-layer counts of one batch and their totals."""

    rows: list[LayerCount]
    batch_size: int | None
    params: int
    trainable_params: int
    counted_backward: bool = True
    notes: list[str] = field(default_factory=list)

    def total(self, attribute: str) -> int:
        return sum(getattr(row, attribute) for row in self.rows)

    @property
    def forward_FLOPs(self) -> int:
        return self.total("forward_FLOPs")

    @property
    def backward_FLOPs(self) -> int:
        return self.total("backward_FLOPs")

    @property
    def train_FLOPs(self) -> int:
        return self.forward_FLOPs + self.backward_FLOPs

    @property
    def forward_MACs(self) -> int:
        return self.forward_FLOPs // 2

    @property
    def study_MACs(self) -> int:
        return self.total("study_MACs")

    def row(self, name: str) -> LayerCount:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(f"no layer named {name!r}; layers: {[r.name for r in self.rows]}")

    def as_dict(self) -> dict:
        return {
            "batch_size": self.batch_size,
            "params": self.params,
            "trainable_params": self.trainable_params,
            "forward_FLOPs": self.forward_FLOPs,
            "forward_MACs": self.forward_MACs,
            "backward_FLOPs": self.backward_FLOPs,
            "train_FLOPs": self.train_FLOPs,
            "study_MACs": self.study_MACs,
            "layers": [{**asdict(row), "forward_MACs": row.forward_MACs} for row in self.rows],
            "notes": list(self.notes),
        }

    # --- rendering -----------------------------------------------------------------------------
    COLUMNS = ("layer", "type", "params", "fwd MACs", "fwd FLOPs", "bwd FLOPs", "study MACs", "output")

    def _cells(self) -> list[list[str]]:
        cells = []
        for r in self.rows:
            cells.append([r.name, r.kind, f"{r.params:,}", f"{r.forward_MACs:,}", f"{r.forward_FLOPs:,}",
                          f"{r.backward_FLOPs:,}", f"{r.study_MACs:,}", "x".join(map(str, r.output_shape))])
        cells.append(["total", "", f"{self.params:,}", f"{self.forward_MACs:,}", f"{self.forward_FLOPs:,}",
                      f"{self.backward_FLOPs:,}", f"{self.study_MACs:,}", ""])
        return cells

    def format(self) -> str:
        """A plain-text table (console)."""
        cells = [list(self.COLUMNS), *self._cells()]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.COLUMNS))]
        lines = []
        for k, row in enumerate(cells):
            lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        batch = f" (batch {self.batch_size})" if self.batch_size else ""
        return f"FLOPs and MACs of one batch{batch}\n" + "\n".join(lines)

    def markdown(self) -> str:
        """A Markdown table (TensorBoard text)."""
        header = "| " + " | ".join(self.COLUMNS) + " |\n|" + "---|" * len(self.COLUMNS) + "\n"
        return header + "\n".join("| " + " | ".join(c or " " for c in row) + " |" for row in self._cells())

    def csv_text(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["layer", "type", "params", "forward_MACs", "forward_FLOPs", "backward_FLOPs",
                         "study_MACs", "calls", "input_shape", "output_shape", "dtype"])
        for r in self.rows:
            writer.writerow([r.name, r.kind, r.params, r.forward_MACs, r.forward_FLOPs, r.backward_FLOPs,
                             r.study_MACs, r.calls, "x".join(map(str, r.input_shape)),
                             "x".join(map(str, r.output_shape)), r.dtype])
        return out.getvalue()


def study_macs(module: nn.Module, input_shape: tuple, output_shape: tuple) -> int:
    """MACs of one forward call in the Baler study's (ptflops') convention; 0 for other layer types."""
    if isinstance(module, nn.Linear):
        return math.prod(input_shape) * module.out_features + (module.out_features if module.bias is not None else 0)
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        positions = output_shape[0] * math.prod(output_shape[2:])
        per_position = math.prod(module.kernel_size) * module.in_channels * (module.out_channels // module.groups)
        bias = module.out_channels * positions if module.bias is not None else 0
        return per_position * positions + bias
    return 0


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


class FlopsRecorder:
    """Counts what runs while it is active: FLOPs per module, and shapes and study MACs per leaf layer.

    ``with FlopsRecorder(model) as rec: out = model(x); rec.forward_done(); loss.backward()`` then
    ``rec.table()``. Without ``forward_done()`` everything counted is taken as forward.
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self._names = {m: name or ROOT_ROW for name, m in model.named_modules()}
        self._leaves = {m: name for m, name in self._names.items() if not any(True for _ in m.children())}
        self._rows: dict[str, LayerCount] = {}
        self._forward_counts: dict[str, int] | None = None
        self._all_counts: dict[str, int] = {}
        self._counter: FlopCounterMode | None = None
        self._hooks: list = []
        self.batch_size: int | None = None  # of the counted batch, set by the caller

    def __enter__(self) -> "FlopsRecorder":
        for module, name in self._leaves.items():
            self._hooks.append(module.register_forward_hook(self._make_hook(name)))
        self._counter = FlopCounterMode(display=False)
        self._counter.__enter__()
        return self

    def _make_hook(self, name: str):
        def hook(module, inputs, output) -> None:
            x, y = _first_tensor(inputs), _first_tensor(output)
            row = self._rows.get(name)
            if row is None:
                row = self._rows[name] = LayerCount(name, type(module).__name__,
                                                    params=sum(p.numel() for p in module.parameters()),
                                                    bias=isinstance(getattr(module, "bias", None), torch.Tensor))
            row.calls += 1
            if x is not None:
                row.input_shape = tuple(x.shape)
            if y is not None:
                row.output_shape = tuple(y.shape)
                row.dtype = str(y.dtype).replace("torch.", "")
            if isinstance(module, STUDY_LAYERS) and x is not None and y is not None:
                row.study_MACs += study_macs(module, tuple(x.shape), tuple(y.shape))
        return hook

    @property
    def forward_marked(self) -> bool:
        return self._forward_counts is not None

    def forward_done(self) -> None:
        """Mark the end of the forward pass: counts from here on are backward."""
        self._forward_counts = self._module_totals()

    def __exit__(self, *exc) -> None:
        self._all_counts = self._module_totals()
        self._counter.__exit__(*exc)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _module_totals(self) -> dict[str, int]:
        counts = self._counter.get_flop_counts()
        totals: dict[str, int] = {}
        for tracker_name, ops in counts.items():
            name = "Global" if tracker_name == "Global" else self._resolve(tracker_name)
            totals[name] = totals.get(name, 0) + sum(ops.values())
        return totals

    def _resolve(self, tracker_name: str) -> str:
        """Our module path for a FlopCounterMode name ('<RootClass>.a.b', rooted where first seen)."""
        head, _, rest = tracker_name.partition(".")
        for module, prefix in self._names.items():
            if type(module).__name__ != head:
                continue
            try:
                target = module.get_submodule(rest) if rest else module
            except AttributeError:
                continue
            path = ".".join(p for p in (prefix, rest) if p and p != ROOT_ROW) or ROOT_ROW
            if self._names.get(target) == path:
                return path
        return tracker_name

    def table(self) -> FlopsTable:
        all_counts = self._all_counts
        forward = self._forward_counts if self._forward_counts is not None else all_counts
        rows = [self._rows[name] for name in self._leaves.values() if name in self._rows]
        for row in rows:
            row.forward_FLOPs = forward.get(row.name, 0)
            row.backward_FLOPs = all_counts.get(row.name, 0) - row.forward_FLOPs
        other = LayerCount(OTHER_ROW, "")
        other.forward_FLOPs = forward.get("Global", 0) - sum(r.forward_FLOPs for r in rows)
        backward_total = all_counts.get("Global", 0) - forward.get("Global", 0)
        other.backward_FLOPs = backward_total - sum(r.backward_FLOPs for r in rows)
        leaf_params = {id(p) for m in self._leaves for p in m.parameters()}
        other.params = sum(p.numel() for p in self.model.parameters() if id(p) not in leaf_params)
        if other.forward_FLOPs or other.backward_FLOPs or other.params:
            rows.append(other)
        params = list(self.model.parameters())
        return FlopsTable(
            rows=rows,
            batch_size=self.batch_size,
            params=sum(p.numel() for p in params),
            trainable_params=sum(p.numel() for p in params if p.requires_grad),
            counted_backward=self._forward_counts is not None,
        )


def count_model(model: nn.Module, example_input: Any, backward: bool = True) -> FlopsTable:
    """Counts of one forward (and backward) pass of ``model`` on ``example_input``.

    ``example_input``: a tensor, a tuple of positional arguments or a dict of keyword arguments. The
    backward pass differentiates the sum of the floating-point outputs with respect to the trainable
    parameters (``torch.autograd.grad``: the parameters' ``.grad`` stay untouched); buffers such as
    BatchNorm running statistics are restored afterwards.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}")
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        with FlopsRecorder(model) as recorder:
            recorder.batch_size = first_batch_size(example_input)
            if isinstance(example_input, dict):
                output = model(**example_input)
            elif isinstance(example_input, (tuple, list)):
                output = model(*example_input)
            else:
                output = model(example_input)
            if backward and params:
                recorder.forward_done()
                outputs = [t for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
                if outputs:
                    total = sum(t.sum() for t in outputs)
                    torch.autograd.grad(total, params, allow_unused=True)
    finally:
        with torch.no_grad():
            for name, value in buffers.items():
                model.get_buffer(name).copy_(value)
    table = recorder.table()
    if backward and not params:
        table.notes.append("no trainable parameters: backward FLOPs not counted")
    return table


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []
