"""The benchmarks, ``splitserve bench NAME``: figures printed beside a baseline measured in the same run.

The top of the house: they start clusters with ``splitserve.launcher`` and load them as clients, or run the engine
in-process; nothing imports them (``splitserve/cli.py`` loads ``splitserve.bench.NAME`` by name when its subcommand runs).

- ``engine.py``: the engine against ``transformers`` on the same weights, prefill and decode;
- ``codecs.py``: every KV codec's size, speed and model quality against the lossless path;
- ``transfer.py``: a prompt's KV pushed between real pods, overlap on and off, per codec;
- ``phases.py`` (with ``step_cost.py``, a step's FLOPs and bytes): prefill and decode against the machine's limits;
- ``serve.py``: a running router as its clients see it (``workload.py``, ``prompts.py``, ``serve_client.py``,
  ``serve_metrics.py``, ``serve_plots.py``);
- ``compare.py``: disaggregated, colocated and conditional serving on the same cores (``compare_plan.py``: the
  topologies and their results; ``compare_plots.py``);
- ``soak.py``: a cluster under load with injected faults;
- ``spec.py``: speculative decoding on vs off, the same requests through two engines taking turns.
"""

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
    """A benchmark's finished matplotlib figure, laid out and written to ``path`` (then closed: pyplot keeps every
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
