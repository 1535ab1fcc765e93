"""The ``servewatch`` command line: the console script's entry, the commands, launch and summaries."""
