"""Re-exported assertions for test modules (conftest is not importable by name)."""

from conftest import DEFAULT_NAME, WIKITEXT, assert_one_line_error, store_snapshot  # noqa: F401
