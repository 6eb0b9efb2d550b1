"""The ``trunksplit`` command: ``plan``, ``bench``, ``fit`` and ``bench-data`` (see ``main.py``)."""
from .main import main

__all__ = ["main"]
