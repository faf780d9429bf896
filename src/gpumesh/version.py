"""This release's version: one place, at the bottom floor, so every layer may say it."""

__version__ = "0.1.0"

VERSION_HEADER = "x-gpumesh-version"
"""The header in which the node process's ``GET /api/v1/node`` names its version."""
