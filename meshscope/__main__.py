"""``python -m meshscope ...`` is the ``meshscope`` command."""

import sys

from meshscope.cli import main

sys.exit(main())
