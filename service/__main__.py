"""``python -m service`` runs the ``lmhead`` command line."""

from service.cli import main

raise SystemExit(main())
