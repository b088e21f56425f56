"""Grafana dashboards generated from code (``dashboards.py``); ``python -m deploy.grafana`` writes the JSON."""
