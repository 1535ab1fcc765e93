"""Wiring only: the agent built from the settings, supervision, its own status rows."""
