"""The span mirror of bus events and the torch trace import."""
