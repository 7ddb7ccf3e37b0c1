"""The ``lightning-energy`` command: :mod:`lightning_energy.cli.main` and one module per sub-command under
:mod:`lightning_energy.cli.commands`. ``python -m lightning_energy.cli`` runs it."""


def __getattr__(name: str):
    # console scripts installed before the move call ``lightning_energy.cli:main``
    if name == "main":
        from lightning_energy.cli.main import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
