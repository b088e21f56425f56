"""What a benchmark's or a simulation's ``--json`` and ``--plot`` write: ``FiguresOutput`` (the two flags, which a
benchmark's config dataclass extends), ``save_results``, and matplotlib's file-only pyplot (``headless_pyplot``,
``save_figure``)."""

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.runtime.config import described


@dataclass
class FiguresOutput:
    """Where a benchmark also puts its figures; its config dataclass extends this one, and its command line comes
    from that dataclass (``splitserve.runtime.config.parse_config``, as the services' do)."""

    json: str = field(default="", metadata=described("Also write the figures to this JSON file."))
    plot: str = field(default="", metadata=described("Also draw the figures into this .png file."))


def headless_pyplot():
    """matplotlib's pyplot on the file-only Agg backend (servers have no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, dpi: int = 120) -> None:
    """A finished matplotlib figure, laid out and written to ``path`` (then closed: pyplot keeps every
    open figure)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    headless_pyplot().close(fig)


def save_results(results, json_path: str | None, plot_path: str | None = None,
                 plot: Callable[[object, str], None] | None = None) -> None:
    """What ``--json`` and ``--plot`` ask for: the figures as JSON, and drawn by ``plot(results, path)``."""
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))
    if plot_path:
        plot(results, plot_path)
