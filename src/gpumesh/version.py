"""This release's version: one place, at the bottom floor, so every layer may say it."""

__version__ = "0.1.0"
