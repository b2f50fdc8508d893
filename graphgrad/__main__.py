"""``python -m graphgrad`` runs the command line."""

import sys

from graphgrad.cli._main import main

sys.exit(main())
