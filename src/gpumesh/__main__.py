"""``python -m gpumesh`` runs the CLI."""

import sys

from gpumesh.cli.main import main

sys.exit(main())
