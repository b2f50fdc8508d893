"""``python -m graphgrad`` runs the command line."""

import sys

from graphgrad._cli import main

sys.exit(main())
