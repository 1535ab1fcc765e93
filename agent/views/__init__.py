"""Offline readers of an incident bundle, used by the command line: bundle, timeline, report, console."""
