"""Lightning glue every callback of the suite shares: the per-Trainer session, its one timeline, the
callback base class. ``lightning_energy.measure``-level code (sensors, sampler, meter) never imports it."""
