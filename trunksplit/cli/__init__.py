"""The ``trunksplit`` command: its arguments in ``parser.py`` (no torch), what each command runs in
``commands.py`` and ``runs.py``."""
from .parser import main

__all__ = ["main"]
