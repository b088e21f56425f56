"""``python -m splitserve.deploy.grafana``: regenerate ``deploy/grafana/dashboards/*.json`` from ``dashboards.py``."""

import sys

from splitserve.deploy.grafana.dashboards import write_all

print("wrote " + ", ".join(str(p) for p in write_all()), file=sys.stderr)
