"""A stand-in for SGLang's ``sglang`` package with its real module paths (``sglang/launch_server.py``,
``sglang/srt/managers/scheduler.py``, ``sglang/srt/managers/detokenizer_manager.py``) and real titles
(``sglang::scheduler_TP<i>``, ``sglang::detokenizer``; the main process keeps its command line), put
on a test server's ``PYTHONPATH`` only (``tests/programs/frontend_cases.py``): an asyncio HTTP
frontend with its tokenizer manager, TP schedulers that generate, a detokenizer; no model. Never
imported by servewatch itself."""
