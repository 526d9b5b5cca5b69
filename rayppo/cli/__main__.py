"""``python -m rayppo.cli``: the ``rayppo`` command."""

import sys

from rayppo.cli import main

sys.exit(main())
