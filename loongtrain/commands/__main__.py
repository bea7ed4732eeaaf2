"""``python -m loongtrain.commands``: the ``loongtrain`` command."""

import sys

from loongtrain.commands import main

sys.exit(main())
