"""``python -m splitserve.decode_service [--flags]``: run a decode (or, with ``--role mixed``, a mixed) pod."""

import sys

from splitserve.decode_service.server import main

main(sys.argv[1:])
