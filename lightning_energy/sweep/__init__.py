"""``lightning-energy sweep``: a grid of runs (precision x batch size x power limit) from one YAML file."""
