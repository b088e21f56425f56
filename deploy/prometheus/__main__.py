"""``python -m splitserve.deploy.prometheus``: rewrite ``splitserve-rules.yaml`` from the chart's rules."""

import sys

from splitserve.deploy.prometheus import RULES_PATH, render_rules

RULES_PATH.write_text(render_rules())
print(f"wrote {RULES_PATH}", file=sys.stderr)
