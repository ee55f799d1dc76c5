"""Test support: synthetic GGUFs, the fake Hub, constants, runners and shared fixtures.

Imported as `support.*` (tests/ is on pytest's pythonpath in pyproject.toml).
"""
