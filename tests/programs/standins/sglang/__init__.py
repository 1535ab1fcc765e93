"""A stand-in for SGLang's ``sglang`` package with its real module paths, put on a test process's
``PYTHONPATH`` only: ``sglang/launch_server.py``, ``sglang/srt/managers/scheduler.py`` and
``sglang/srt/managers/detokenizer_manager.py`` with real titles (``sglang::scheduler_TP<i>``,
``sglang::detokenizer``; ``tests/programs/frontend_cases.py``: an asyncio HTTP frontend with its
tokenizer manager, TP schedulers that generate, a detokenizer; no model), and the decode CUDA-graph
runner (``sglang/srt/model_executor/runner/``) whose capture a start-up hang never leaves. Never
imported by servewatch itself."""
