"""The one logging setup of every splitserve process: timestamp, level, logger name, message, on stderr."""

from __future__ import annotations

import logging
import os

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging() -> None:
    """Set the root logger up once per process; ``SPLITSERVE_LOG_LEVEL`` (default INFO) sets the level."""
    level = os.environ.get("SPLITSERVE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=FORMAT)
