"""A stand-in for vLLM's ``vllm`` package with its real module paths, put on a test process's
``PYTHONPATH`` only: ``vllm/entrypoints/openai/api_server.py``, ``vllm/entrypoints/chat_utils.py``,
``vllm/v1/engine/core.py`` and ``vllm/v1/executor/multiproc_executor.py`` with real titles
(``VLLM::EngineCore``, ``VLLM::Worker_TP<i>``; ``tests/programs/frontend_cases.py``: an asyncio
HTTP frontend, its engine core and workers, no model), and the GPU model runner
(``vllm/v1/worker/gpu_model_runner.py``) whose graph capture a start-up hang never leaves. Never
imported by servewatch itself."""
