"""``python -m knitkit`` runs the command line."""

import sys

from knitkit.cli import main

sys.exit(main())
