"""Fixtures of the attack tests (see :mod:`tests.security._attack`)."""

from tests.security._attack import attack_programs, host_files, nobody_dir, shared_tmpfs

__all__ = ["attack_programs", "host_files", "nobody_dir", "shared_tmpfs"]
