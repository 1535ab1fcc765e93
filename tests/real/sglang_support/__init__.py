"""Files the real-SGLang installer copies into the SGLang venv (never imported from the tests'
own interpreter): ``sgl_kernel_cpu.py`` (the ``sgl_kernel`` CPU stand-in, the install's one
deviation) and ``servewatch_sglang_faults.py`` (the per-rank fault hook SGLang loads through
``--forward-hooks``)."""
