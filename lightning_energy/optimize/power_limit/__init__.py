"""GPU power limit: the search (objectives, exhaustive and adaptive), the profile file, the card control."""
