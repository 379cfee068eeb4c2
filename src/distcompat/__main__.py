"""``python -m distcompat``: the same as the ``distcompat`` console script."""

import sys

from distcompat.cli import main

sys.exit(main())
