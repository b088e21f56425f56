"""``python -m splitserve.prefill_service [--flags]``: run a prefill pod."""

import sys

from splitserve.prefill_service.server import main

main(sys.argv[1:])
