"""A 2-process DDP fit on CPU with EnergyCallback and PrometheusCallback; run by test_prometheus.py as two
ranks forked by rank_zygote.py (by hand, Lightning relaunches it for rank 1). argv: out_dir, the endpoint's port, the Pushgateway's address. After the fit, rank 0
reads its own endpoint (local rank 0 serves the node's ranks) and writes it to ``served.txt`` in out_dir."""

import os
import sys
import urllib.request

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L  # noqa: E402

from conftest import close_process_group, TinyRegressor, tiny_loader  # noqa: E402
from lightning_energy import EnergyCallback, SimulatedSensor  # noqa: E402
from lightning_energy.callbacks.prometheus import PrometheusCallback  # noqa: E402

if __name__ == "__main__":
    out_dir, port, pushgateway = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    energy = EnergyCallback(sensors=[SimulatedSensor("device", 80.0, kind="energy"),
                                     SimulatedSensor("host", 25.0, scope="host")],
                            verbose=False, log_power_figure=False, write_trace=False)
    exporter = PrometheusCallback(port=port, address="127.0.0.1", pushgateway=pushgateway, job="ddp-fit")
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=2, default_root_dir=out_dir,
                        callbacks=[energy, exporter], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(TinyRegressor(), tiny_loader(n=128), tiny_loader(n=32))
    if trainer.global_rank == 0:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
            served = reply.read().decode()
        with open(os.path.join(out_dir, "served.txt"), "w") as fh:
            fh.write(served)
    exporter.exporter.close()
    close_process_group()
