"""Tests on a real vLLM server (vLLM 0.32.0 CPU build on a tiny locally built Llama).

``install.py`` makes the separate vLLM venv and the model (cached between runs), ``server.py``
starts and stops ``vllm serve`` on loopback, ``conftest.py`` hands them to tests as fixtures;
``plugin/`` is the vLLM general plugin that hangs a worker's forward on demand. Every test here
carries the ``realvllm`` marker: ``pytest -m realvllm`` runs them alone.
"""
