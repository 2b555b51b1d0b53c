"""`python -m kubetrain ...` is the same as the `kubetrain` console script."""

import sys

from kubetrain.cli import main

sys.exit(main())
