"""``python -m loongtrain.commands``: the ``loongtrain`` command."""

from loongtrain.commands import cli

cli()
