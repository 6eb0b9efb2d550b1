"""The ``trunksplit`` command: ``plan``, ``bench`` and ``fit`` (see ``main.py``)."""
from .main import main

__all__ = ["main"]
