"""The vocabulary: events and the names they carry, the bus, ids, stacks, ranks, progress, safe text, backoff, lazy imports. No I/O, no policy."""
