"""`python -m hybrid_engine.cli`: the `hybrid-engine` console script."""

import sys

from hybrid_engine.cli import main

sys.exit(main())
