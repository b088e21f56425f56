"""``python -m prefill_service [--flags]``: run a prefill pod."""

import sys

from prefill_service.server import main

main(sys.argv[1:])
