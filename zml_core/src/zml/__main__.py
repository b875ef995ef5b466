"""``python -m zml``: the same command line as ``zml``."""

import sys

from zml.cli import main

sys.exit(main())
