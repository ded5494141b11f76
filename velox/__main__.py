"""`python -m velox` is the `velox` command.

Imports: cli.
"""

import sys

from velox.cli import main

sys.exit(main())
