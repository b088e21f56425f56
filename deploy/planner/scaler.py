"""The planner's hands: read and set the replica counts of the chart's prefill and decode Deployments through
their scale subresource (``apps/v1 deployments/scale``), which is all its Role allows.
"""

from __future__ import annotations

from pathlib import Path

from kubernetes import client, config as kube_config

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def api_client(kubeconfig: str = "") -> client.ApiClient:
    """In a pod: its service account; elsewhere ``kubeconfig`` (or ~/.kube/config)."""
    if not kubeconfig and SERVICE_ACCOUNT_NAMESPACE.exists():
        kube_config.load_incluster_config()
        return client.ApiClient()
    return kube_config.new_client_from_config(config_file=kubeconfig or None)


def own_namespace() -> str:
    if SERVICE_ACCOUNT_NAMESPACE.exists():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return "default"


class DeploymentScaler:
    """Scales named Deployments of one namespace."""

    def __init__(self, api: client.ApiClient, namespace: str, deployments: dict[str, str]):
        self.apps = client.AppsV1Api(api)
        self.namespace = namespace
        self.deployments = deployments  # pool -> Deployment name

    def replicas(self) -> dict[str, int]:
        """Each pool's desired replica count (``spec.replicas`` of its scale)."""
        return {pool: self.apps.read_namespaced_deployment_scale(name, self.namespace).spec.replicas or 0
                for pool, name in self.deployments.items()}

    def scale(self, pool: str, replicas: int) -> None:
        self.apps.patch_namespaced_deployment_scale(self.deployments[pool], self.namespace,
                                                    {"spec": {"replicas": replicas}})
