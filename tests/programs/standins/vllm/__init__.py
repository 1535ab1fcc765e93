"""A stand-in for vLLM's ``vllm`` package with its real module paths (``vllm/entrypoints/openai/api_server.py``,
``vllm/entrypoints/chat_utils.py``, ``vllm/v1/engine/core.py``, ``vllm/v1/executor/multiproc_executor.py``)
and real titles (``VLLM::EngineCore``, ``VLLM::Worker_TP<i>``), put on a test server's ``PYTHONPATH``
only (``tests/programs/frontend_cases.py``): an asyncio HTTP frontend, its engine core and workers,
no model. Never imported by servewatch itself."""
