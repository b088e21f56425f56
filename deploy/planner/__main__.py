"""``python -m splitserve.deploy.planner [--flags]``: run the planner (flags: ``--help``; every field of
``PlannerConfig``)."""

import sys

from splitserve.deploy.planner.controller import main

main(sys.argv[1:])
