"""`python -m velox` is the `velox` command.
"""

import sys

from velox.cli import main

sys.exit(main())
