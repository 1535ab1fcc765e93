"""Stand-in package (see ``sglang/__init__.py``)."""
