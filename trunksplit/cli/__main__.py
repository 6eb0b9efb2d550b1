import sys

from .parser import main

sys.exit(main())
