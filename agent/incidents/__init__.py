"""When an incident opens, for which server, and what runs: the manager, its admission, evidence and history."""
