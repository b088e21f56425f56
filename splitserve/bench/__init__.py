"""Benchmarks that print figures side by side with a baseline measured in the same run (``splitserve bench``)."""

import json
from collections.abc import Callable
from pathlib import Path


def headless_pyplot():
    """matplotlib's pyplot on the file-only Agg backend (servers have no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_results(results, json_path: str | None, plot_path: str | None = None,
                 plot: Callable[[object, str], None] | None = None) -> None:
    """What ``--json`` and ``--plot`` ask for: the figures as JSON, and drawn by ``plot(results, path)``."""
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))
    if plot_path:
        plot(results, plot_path)
