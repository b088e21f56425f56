"""splitserve's command line, the top of the house: it starts services and nothing below imports it.

- ``cli.py``: ``splitserve up | generate | router | prefill | decode | demo | bench``;
- ``launcher.py``: ``splitserve up``, the whole system on this machine, one process per pod;
- ``client.py``: ``splitserve generate``, a gRPC client of the router;
- ``bench/``: benchmarks that print figures beside a baseline measured in the same run.
"""
