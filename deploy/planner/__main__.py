"""``python -m deploy.planner [--flags]``: run the planner (flags: ``--help``; every field of ``PlannerConfig``)."""

import sys

from deploy.planner.controller import main

main(sys.argv[1:])
