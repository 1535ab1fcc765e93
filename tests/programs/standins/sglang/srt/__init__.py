"""Stand-in of SGLang's package path for test ranks (tests/programs/standins)."""
