"""A stand-in for DeepEP's ``deep_ep`` package (its real module path: ``deep_ep/buffer.py``,
class ``Buffer``), put on a test rank's ``PYTHONPATH`` only (``tests/programs/fault_matrix.py``):
no GPU, no NVSHMEM, the same host-side wait. Never imported by servewatch itself."""

from deep_ep.buffer import Buffer

__all__ = ["Buffer"]
