"""Stand-in of vLLM's package path for test ranks (tests/programs/standins)."""
