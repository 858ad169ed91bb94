"""`python -m mpiasgd ...`: the same as the `mpiasgd` command."""

import sys

from mpiasgd.cli import main

sys.exit(main())
