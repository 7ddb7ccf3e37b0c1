"""Dry-run simulators the product uses: the GPU model that power-limit sweeps and the shipped configs run on
(:mod:`~lightning_energy.simulate.gpu_sim`), the simulated sensor (``lightning_energy.SimulatedSensor``) and a tiny
example model (``configs/sweep_tiny.yaml``). Of the product code only the sweep imports it (a sweep with ``sensors:
simulated`` is a documented dry run; ``tests/test_layout.py`` checks this); test-only doubles live under tests/."""
