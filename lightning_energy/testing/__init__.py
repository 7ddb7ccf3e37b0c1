"""Test doubles for tests and dry runs: the GPU simulator, the simulated sensor, a tiny example model.
Importable by users; the product code of lightning_energy never imports it."""
