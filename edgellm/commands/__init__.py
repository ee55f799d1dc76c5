"""CLI commands, one module per capability; imported lazily by edgellm.cli."""
