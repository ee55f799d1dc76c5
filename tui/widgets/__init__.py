"""Widgets of the edgellm TUI."""
