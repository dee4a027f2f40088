"""`python -m loadlab` is the `loadlab` command."""

import sys

from loadlab.cli import main

sys.exit(main())
