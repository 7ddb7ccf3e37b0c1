"""Sub-commands of the ``lightning-energy`` command (see ``lightning_energy.cli.main``)."""


class CommandError(Exception):
    """A problem with the user's input: printed as one line, exit code 2."""
