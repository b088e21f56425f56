"""Benchmarks that print figures side by side with a baseline measured in the same run (``splitserve bench``)."""


def headless_pyplot():
    """matplotlib's pyplot on the file-only Agg backend (servers have no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
