"""The CUDA tier (``python -m pytest -m cuda``): every test skips, saying why, where torch sees no GPU."""
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS is deterministic only with it, set before CUDA starts
