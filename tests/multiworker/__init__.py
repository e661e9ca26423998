"""Multi-worker runs as local processes: the harness that starts them, the programs they run.

Not named `multiprocess`: pytest puts tests/ on sys.path, where a package of that name would
shadow the PyPI `multiprocess` that Hugging Face `datasets` imports.
"""
