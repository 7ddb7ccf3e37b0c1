"""``python -m lightning_energy.cli``."""

import sys

from lightning_energy.cli.main import main

sys.exit(main())
