"""Grafana dashboards generated from code (``dashboards.py``); ``python -m splitserve.deploy.grafana`` writes the JSON."""
