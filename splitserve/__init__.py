"""splitserve's command line and local launcher (``splitserve demo | bench ...``)."""
