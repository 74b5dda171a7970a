"""`python -m miles_core.cli ARGS...`: the `miles` command without its console script."""

import sys

from miles_core.cli import main

sys.exit(main())
