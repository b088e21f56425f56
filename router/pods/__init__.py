"""The router's view of the pods: the registry of which pods exist and how loaded they are, one live monitor and one client per pod."""
