"""Swarm-facing modules: the only code that imports hivemind."""
