"""Figures one component of a run offers the others, by name: how callbacks reach each other's figures
without importing each other (a carbon intensity, an energy-to-target result)."""

from __future__ import annotations

from typing import Any


class Published:
    """A run's board of named figures: ``publish(name, value)`` by the component that owns them,
    ``get(name)`` by any other. Values are whatever the publisher documents for the name."""

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}

    def publish(self, name: str, value: Any) -> None:
        """Offer ``value`` under ``name`` (replacing an earlier one)."""
        self._values[name] = value

    def get(self, name: str, default: Any = None) -> Any:
        """The value published under ``name``, else ``default``."""
        return self._values.get(name, default)

    def __contains__(self, name: str) -> bool:
        return name in self._values
