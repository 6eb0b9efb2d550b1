"""``python -m trunksplit``: the ``trunksplit`` command, where the console script is not on PATH."""
import sys

from .cli.parser import main

sys.exit(main())
