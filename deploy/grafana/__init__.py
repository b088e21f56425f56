"""Grafana dashboards generated from code (``dashboards.py``); ``python -m splitserve.deploy.grafana`` writes the JSON;
``snapshot.py`` draws a dashboard's panels from a Prometheus server with matplotlib, where there is no Grafana.
"""
