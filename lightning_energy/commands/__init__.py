"""Sub-commands of the ``lightning-energy`` command (see ``lightning_energy.cli``)."""
