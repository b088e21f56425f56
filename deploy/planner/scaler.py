"""The planner's hands: read the chart's prefill and decode Deployments (``get deployments``: the replicas asked for
and those ready) and set their replica counts through the scale subresource (``patch deployments/scale``), which is
all its Role allows. Every call has a timeout.
"""

from __future__ import annotations

from pathlib import Path

from kubernetes import client
from kubernetes import config as kube_config

from splitserve.deploy.planner.capacity import Replicas

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

    def __init__(self, api: client.ApiClient, namespace: str, deployments: dict[str, str], timeout_s: float = 10.0):
        self.apps = client.AppsV1Api(api)
        self.namespace = namespace
        self.deployments = deployments  # pool -> Deployment name
        self.timeout_s = timeout_s

    def replicas(self) -> dict[str, Replicas]:
        """Each pool's replicas: asked for (``spec.replicas``) and ready (``status.readyReplicas``)."""
        found = {}
        for pool, name in self.deployments.items():
            deployment = self.apps.read_namespaced_deployment(name, self.namespace, _request_timeout=self.timeout_s)
            found[pool] = Replicas(deployment.spec.replicas or 0, (deployment.status.ready_replicas or 0)
                                   if deployment.status else 0)
        return found

    def scale(self, pool: str, replicas: int) -> None:
        self.apps.patch_namespaced_deployment_scale(self.deployments[pool], self.namespace,
                                                    {"spec": {"replicas": replicas}}, _request_timeout=self.timeout_s)
