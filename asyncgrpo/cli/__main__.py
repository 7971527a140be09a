"""`python -m asyncgrpo.cli ...`: the `asyncgrpo` command without its console script."""

import sys

from asyncgrpo.cli.main import main

sys.exit(main())
