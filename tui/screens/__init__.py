"""Screens of the edgellm TUI."""
