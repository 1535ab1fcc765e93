"""Tests on a real vLLM server (vLLM 0.32.0 CPU build on a tiny locally built Llama).

``install.py`` makes the separate vLLM venv and the model (cached between runs), ``server.py``
starts and stops ``vllm serve`` on loopback, ``conftest.py`` hands them to tests as fixtures;
``plugin/`` is the vLLM general plugin that hangs a worker's forward on demand. Every test here
carries the ``realvllm`` marker: ``pytest -m realvllm`` runs them alone.

The real SGLang server (SGLang 0.5.23 on the CPU engine, same tiny model): ``install_sglang.py``
makes its venv (``sglang_support/``: the ``sgl_kernel`` CPU stand-in and the per-rank fault hook
it installs), ``sglang_server.py`` starts and stops ``sglang.launch_server``, ``conftest.py``
hands it out as ``sglang_tp1`` / ``sglang_tp2`` / ``real_sglang`` after the vLLM tests, under the
same machine-wide lock; those tests also carry ``realsglang`` (``pytest -m realsglang``).
"""
