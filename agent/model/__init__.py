"""The vocabulary: events and the names they carry, the bus, ids, stacks, ranks, progress, safe text, backoff, lazy imports, the data dir's layout. No I/O, no policy."""
