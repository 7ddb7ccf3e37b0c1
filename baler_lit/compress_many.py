"""Compress many files as a Lightning ``predict`` run: one ``.baler`` per input, the inputs sharded over the ranks.

``baler-lit compress-many --ckpt best.ckpt --inputs a.npz b.npz ... --output-dir out/ --devices 2`` runs
:class:`CompressFiles` through ``Trainer.predict`` with the chosen strategy (``ddp`` on CPU ranks here; GPUs
and nodes for users: ``--accelerator``, ``--num-nodes``). Each input goes to exactly one rank (input ``i`` to
rank ``i mod world size``, not Lightning's DistributedSampler, which pads the last shard by repeating inputs),
each rank compresses its files one by one with the streaming :func:`~baler_lit.compression.compress`, and
rank 0 writes ``manifest.json`` after gathering every rank's results: the checkpoint used (its path, byte
size and SHA-256, hashed once before any file is compressed, so the manifest says which weights made every file
and a rerun can be checked against it), the world size, and per input: output, rows, bytes, ratio, corrections
and the rank that made it. Unlike the single-file commands this one imports Lightning.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from .checkpoint import adopt_training_dtypes, load_checkpoint
from .errors import BalerInputError
from .table import atomic_output

MANIFEST = "manifest.json"
#: Bytes read per step while hashing the checkpoint.
HASH_BLOCK = 1 << 20


def checkpoint_identity(path: str | os.PathLike) -> dict[str, Any]:
    """``{"path", "bytes", "sha256"}`` of the checkpoint file at ``path`` (absolute path; hashed block by block)."""
    p = Path(path)
    digest = hashlib.sha256()
    try:
        with open(p, "rb") as fh:
            while block := fh.read(HASH_BLOCK):
                digest.update(block)
    except OSError as exc:
        raise BalerInputError(f"cannot read checkpoint {p}: {exc.strerror or exc}") from None
    return {"path": str(p.resolve()), "bytes": p.stat().st_size, "sha256": digest.hexdigest()}


def output_paths(inputs: list[str], output_dir: Path) -> list[Path]:
    """``output_dir/<input stem>.baler`` per input; two inputs with one stem are refused before any work."""
    outputs = [output_dir / f"{Path(p).stem}.baler" for p in inputs]
    seen: dict[Path, str] = {}
    for src, out in zip(inputs, outputs):
        if out in seen:
            raise BalerInputError(f"inputs {seen[out]} and {src} would both write {out}; rename one")
        seen[out] = src
    return outputs


class CompressFiles(L.LightningModule):
    """``predict_step`` compresses one file (the batch is its index in ``inputs``) and returns its summary."""

    def __init__(self, ckpt: str, inputs: list[str], output_dir: str, latent_dtype: str = "float16",
                 error_bound=None, overwrite: bool = False, npz_key: str = "data") -> None:  # fmt: skip
        super().__init__()
        self.checkpoint = checkpoint_identity(ckpt)  # before loading: the bytes hashed are the bytes loaded
        self.trained = load_checkpoint(ckpt)
        self.inputs = list(inputs)
        self.output_dir = Path(output_dir)
        self.outputs = output_paths(self.inputs, self.output_dir)
        self.latent_dtype = latent_dtype
        self.error_bound = error_bound
        self.overwrite = overwrite
        self.npz_key = npz_key
        self.results: list[dict[str, Any]] = []

    def predict_dataloader(self) -> DataLoader:
        shard = list(range(self.global_rank, len(self.inputs), self.trainer.world_size))
        return DataLoader(shard, batch_size=None, shuffle=False)

    def predict_step(self, index: int, batch_idx: int) -> dict[str, Any]:
        from .compression import compress
        from .row_source import open_rows

        rows = open_rows(self.inputs[index], self.npz_key)
        adopt_training_dtypes(rows, self.trained.column_dtypes)
        result = compress(self.trained.model, self.trained.normalizer, rows, self.outputs[index], self.latent_dtype,
                          dict(self.trained.hparams), self.overwrite, error_bound=self.error_bound)  # fmt: skip
        summary = {
            "input": str(self.inputs[index]), "output": str(result.path), "rows": result.n_rows,
            "original_bytes": result.original_bytes, "file_bytes": result.file_bytes, "ratio": result.ratio,
            "corrections": result.corrections, "constant_columns": result.constant_columns,
            "seconds": result.seconds, "rank": self.global_rank, "warnings": result.warnings,
        }  # fmt: skip
        self.results.append(summary)
        return summary

    def on_predict_epoch_end(self) -> None:
        gathered = [self.results]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, self.results)
        if self.global_rank == 0:
            files = sorted((r for part in gathered for r in part), key=lambda r: self.inputs.index(r["input"]))
            manifest = {"checkpoint": self.checkpoint, "world_size": self.trainer.world_size, "files": files}
            with atomic_output(self.output_dir / MANIFEST, overwrite=True) as fh:
                fh.write(json.dumps(manifest, indent=1).encode())


def compress_many(ckpt: str, inputs: list[str], output_dir: str, devices: int = 1, accelerator: str = "cpu",
                  num_nodes: int = 1, strategy: str = "auto", **kwargs) -> list[dict[str, Any]]:  # fmt: skip
    """Compress ``inputs`` into ``output_dir`` over ``devices`` × ``num_nodes`` ranks; return this rank's results
    (rank 0 also writes ``manifest.json``)."""
    out = Path(output_dir)
    if not out.is_dir():
        raise BalerInputError(f"output directory {out} does not exist")
    if not inputs:
        raise BalerInputError("no inputs given")
    if not kwargs.get("overwrite"):
        existing = [str(p) for p in output_paths(inputs, out) if p.exists()]
        if existing:
            raise BalerInputError(f"output {existing[0]} already exists; pass --overwrite to replace it")
    if strategy == "auto" and devices * num_nodes > 1:
        strategy = "ddp"
    module = CompressFiles(ckpt, inputs, str(out), **kwargs)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    trainer = L.Trainer(accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, default_root_dir=str(out))  # fmt: skip
    trainer.predict(module, return_predictions=False)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Lightning leaves the CPU (gloo) process group open; torn down at interpreter exit it aborts now and then
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return module.results
