"""``python -m torchtrace.cli``: the ``torchtrace`` command."""

import sys

from torchtrace.cli import main

sys.exit(main())
