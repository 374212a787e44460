"""``python -m shardline_runtime serve ...``: same as the ``shardline-runtime`` console script."""

import sys

from shardline_runtime.cli import main

sys.exit(main())
