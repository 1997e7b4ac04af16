"""python -m lean.check: the same as the lean-check command."""
import sys

from . import main

sys.exit(main())
