"""The router's view of the pods: ``registry.py`` (which pods exist, whether they serve, how loaded they are),
``monitor.py`` (one live view per pod, from the health and load streams it pushes) and ``client.py`` (one gRPC client
per pod, the only way the router talks to a pod).
"""
