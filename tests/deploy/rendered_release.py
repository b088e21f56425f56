"""Running a rendered release: each Deployment's container started as its manifest says, on loopback.

    release = RenderedRelease(objects, secrets, workdir)   the chart's rendered objects; Secrets by name -> key -> value
                           (image_root: a built image's root filesystem, e.g. `buildah mount`'s, to run instead)
    release.start()        every Deployment's pod (one each: replicas are not multiplied)
    release.wait_ready()   runs each container's startupProbe, then its readinessProbe, as rendered, until all pass
    release.address(service, port_name)   where a Service's port leads: the pod's address and container port
    release.stop()         SIGTERM to every pod, as the kubelet does, then SIGKILL after the grace period

What is taken from the manifest, as the kubelet would: the command and args with ``$(VAR)`` expanded from the
container's env; the env in order (values, Secret keys, ``status.podIP`` from the downward API, ``$(VAR)`` of the
variables before it); the user and group (``runAsUser`` / ``runAsGroup`` of the container or the pod); a read-only
root (``readOnlyRootFilesystem``) with only the declared volumes mounted (emptyDir: a fresh directory, writable;
secret: the Secret's keys as files, read-only); the probes, each run as rendered (grpc, tcpSocket, httpGet, exec
inside the container's sandbox). bubblewrap (Debian's ``bubblewrap``) builds the sandbox: a user namespace with
the container's uid, the host's root bound read-only, the volumes bound over it.

What stands in for the cluster:
- the splitserve image is this checkout: deploy/Dockerfile's ENV, with its virtual environment ``/opt/venv`` being
  the checkout's ``.venv`` and its kernels ``/opt/splitserve/kernels`` the host's ``~/.cache/splitserve/image``
  (read-only) holding the baseline this CPU runs, built there first as the image's build does
  (``splitserve build-kernels`` with the image's target), or, given ``image_root``, the built image itself; Redis's
  image is the host's ``redis-server`` (the image's entrypoint takes the args);
- a hostPath volume is the host's directory of that path (the test's stand-in for the node's), shared by every pod
  that mounts it, as on one node;
- a pod's IP is a loopback address of its own (127.77.0.n), and a listener the manifest binds to 0.0.0.0
  (``--host 0.0.0.0``) binds to it instead, as a pod's network namespace would keep it apart (Redis also listens
  on 127.0.0.1, for its exec probe's ``redis-cli``);
- cert-manager: ``write_tls_secret`` issues a Secret's files (tls.crt, tls.key, ca.crt) from a throwaway CA, one
  ECDSA identity for server and client auth listing the given names, as the chart's Certificate asks for;
- Service names (``name``, ``name.ns``, ``name.ns.svc``, ``name.ns.svc.cluster.local``) in args and env values
  are replaced by the address of the pod the Service selects: the one rewrite, standing in for cluster DNS.
NetworkPolicies are not enforced on loopback (tests/deploy/test_chart_cluster.py evaluates them).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent
CHECKOUT = Path(__file__).resolve().parents[2]
# Stands in for the image's /opt/splitserve/kernels: its libraries only (not this host's native builds)
IMAGE_KERNELS = Path.home() / ".cache" / "splitserve" / "image"
BWRAP = shutil.which("bwrap")
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def image_env() -> dict[str, str]:
    """deploy/Dockerfile's ENV, as the image sets it (``$PATH`` expanded with a plain PATH)."""
    text = (ROOT / "deploy" / "Dockerfile").read_text().replace("\\\n", " ")
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    for line in re.findall(r"^ENV (.*)$", text, re.MULTILINE):
        for name, value in re.findall(r"(\w+)=(\S+)", line):
            env[name] = value.replace("$PATH", env["PATH"])
    return env


def _host_root(targets: list[str]) -> tuple[list[str], list[str]]:
    """bwrap arguments binding the host's folders read-only onto the sandbox's (empty) root, such that the image's
    mount points (``targets``: /opt/venv, /data, /etc/splitserve/tls) can be made: a host folder that would have to
    hold a missing mount point becomes a tmpfs with its children bound one by one (returned second, to be made
    read-only once the mounts are in). /opt is the image's own."""
    tmpfs: list[str] = []

    def bind(path: Path) -> list[str]:
        if path.is_symlink():
            return ["--symlink", os.readlink(path), str(path)]
        if path.is_dir() and any(path in Path(t).parents and not Path(t).exists() for t in targets):
            tmpfs.append(str(path))
            return ["--tmpfs", str(path), *(arg for child in sorted(path.iterdir()) for arg in bind(child))]
        return ["--ro-bind", str(path), str(path)]

    args = [arg for entry in sorted(os.listdir("/")) if entry not in ("proc", "dev", "opt", "sys")
            for arg in bind(Path("/", entry))]
    return [*args, "--dir", "/opt"], ["/", *tmpfs]


def _build_image_kernels() -> None:
    """What the image's build leaves in its kernel folder for this CPU (the best baseline it runs), built into
    IMAGE_KERNELS as the image's build does (found there by later runs)."""
    env = {**os.environ, "SPLITSERVE_CACHE_DIR": str(IMAGE_KERNELS), "HOME": str(IMAGE_KERNELS),  # no other cache
           "SPLITSERVE_KERNEL_TARGET": image_env()["SPLITSERVE_KERNEL_TARGET"]}
    subprocess.run([str(VENV / "bin" / "python"), "-m", "splitserve", "build-kernels"], env=env, check=True,
                   capture_output=True)


def _kube_expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: a defined variable is replaced, an undefined reference kept, $$ escapes."""
    return re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                  text)


@dataclass
class Pod:
    name: str  # the Deployment's
    ip: str
    spec: dict  # the pod template's spec
    labels: dict
    processes: list[subprocess.Popen] = field(default_factory=list)
    sandboxes: dict[str, list[str]] = field(default_factory=dict)  # container -> bwrap prefix
    envs: dict[str, dict[str, str]] = field(default_factory=dict)

    def container_port(self, port: int | str) -> int:
        if isinstance(port, int):
            return port
        for container in self.spec["containers"]:
            for declared in container.get("ports", []):
                if declared.get("name") == port:
                    return declared["containerPort"]
        raise KeyError(f"pod {self.name} declares no port named {port!r}")


class RenderedRelease:
    def __init__(self, objects: list[dict], secrets: dict[str, dict[str, str]], workdir: Path, image_root: str = ""):
        if BWRAP is None:
            raise RuntimeError("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
        self.workdir, self.secrets, self.image_root = workdir, secrets, image_root
        deployments = [o for o in objects if o["kind"] == "Deployment"]
        self.pods = {d["metadata"]["name"]: Pod(d["metadata"]["name"], f"127.77.0.{n}", d["spec"]["template"]["spec"],
                                                d["spec"]["template"]["metadata"]["labels"])
                     for n, d in enumerate(deployments, start=2)}
        self.services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
        self.namespace = next(iter(objects))["metadata"].get("namespace", "llm")
        self._hosts = self._service_hosts()

    # ---- Services as cluster DNS would resolve them -------------------------------------------------------------

    def _selected(self, service: dict) -> list[Pod]:
        selector = service["spec"].get("selector", {})
        return [pod for pod in self.pods.values() if selector.items() <= pod.labels.items()]

    def _service_hosts(self) -> dict[str, str]:
        hosts = {}
        for name, service in self.services.items():
            selected = self._selected(service)
            if len(selected) == 1:  # a name that resolves to one pod (headless ones over several are for TLS names)
                for host in (name, f"{name}.{self.namespace}", f"{name}.{self.namespace}.svc",
                             f"{name}.{self.namespace}.svc.cluster.local"):
                    hosts[host] = selected[0].ip
        return hosts

    def resolve(self, text: str) -> str:
        """Service names followed by a port or a path, replaced by their pod's address (longest names first)."""
        for host in sorted(self._hosts, key=len, reverse=True):
            text = re.sub(rf"(?<![\w.-]){re.escape(host)}(?=[:/]|$)", self._hosts[host], text)
        return text

    def address(self, service: str, port_name: str) -> tuple[str, int]:
        """Where ``service``'s port ``port_name`` leads: (pod address, container port)."""
        spec = self.services[service]
        (pod,) = self._selected(spec)
        port = next(p for p in spec["spec"]["ports"] if p["name"] == port_name)
        return pod.ip, pod.container_port(port.get("targetPort", port["port"]))

    # ---- containers --------------------------------------------------------------------------------------------

    def _env(self, pod: Pod, container: dict) -> dict[str, str]:
        env = image_env() if "splitserve" in container["image"] else {"PATH": image_env()["PATH"]}
        for var in container.get("env", []):
            if "value" in var:
                value = _kube_expand(var["value"], env)
            elif "secretKeyRef" in var.get("valueFrom", {}):
                ref = var["valueFrom"]["secretKeyRef"]
                value = self.secrets[ref["name"]][ref["key"]]
            elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
                value = pod.ip
            else:
                raise NotImplementedError(f"{pod.name}: env {var}")
            env[var["name"]] = self.resolve(value)
        return env

    def _sandbox(self, pod: Pod, container: dict, directory: Path) -> list[str]:
        """bwrap's arguments: the container's user, a read-only root, its volumes and the image's folders."""
        context = {**pod.spec.get("securityContext", {}), **container.get("securityContext", {})}
        assert context.get("readOnlyRootFilesystem"), f"{pod.name}: a writable root is not emulated"
        mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
        outermost = [m for m in mounts if not any(Path(o) in Path(m).parents for o in mounts)]  # nested: in a volume
        image = self.image_root if "splitserve" in container["image"] else ""
        # a built image's root: bound writable only until its volumes' mount points are made, then read-only
        root, made = (["--bind", image, "/"], ["/"]) if image else \
            _host_root([*outermost, "/opt/venv", "/opt/splitserve/kernels"])
        args = [BWRAP, *root, "--dev", "/dev", "--tmpfs", "/dev/shm", "--proc", "/proc",
                "--unshare-user", "--uid", str(context["runAsUser"]), "--gid", str(context.get("runAsGroup",
                                                                                               context["runAsUser"])),
                "--die-with-parent"]
        if "splitserve" in container["image"]:
            args += ["--chdir", "/tmp"]
        if "splitserve" in container["image"] and not image:
            args += ["--ro-bind", str(VENV), "/opt/venv"]
            args += ["--ro-bind", str(IMAGE_KERNELS), "/opt/splitserve/kernels"]  # read-only, as in the image
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            host = directory / "volumes" / mount["name"]
            if "emptyDir" in volume:
                host.mkdir(parents=True, exist_ok=True)
                host.chmod(0o777)  # an emptyDir is writable by the pod's user (fsGroup)
                args += ["--bind", str(host), mount["mountPath"]]
            elif "hostPath" in volume:  # the node's directory: every pod of the one node sees the same
                args += ["--ro-bind" if mount.get("readOnly") else "--bind", volume["hostPath"]["path"],
                         mount["mountPath"]]
            elif "secret" in volume:
                host.mkdir(parents=True, exist_ok=True)
                for key, value in self.secrets[volume["secret"]["secretName"]].items():
                    (host / key).write_text(value)
                    (host / key).chmod(0o644)
                args += ["--ro-bind", str(host), mount["mountPath"]]
            else:
                raise NotImplementedError(f"{pod.name}: volume {volume}")
        if "splitserve" in container["image"] and not image:
            # The venv's editable install reads the package from this checkout: bound at its own path, read-only,
            # above any volume that would hide it (a checkout under /tmp, the pods' /tmp emptyDir).
            args += ["--ro-bind", str(CHECKOUT), str(CHECKOUT)]
        return [*args, *(arg for path in made for arg in ("--remount-ro", path))]  # mount points made: read-only

    def _command(self, pod: Pod, container: dict, env: dict[str, str]) -> list[str]:
        args = [self.resolve(_kube_expand(arg, env)) for arg in container.get("args", [])]
        # a listener on every address of the pod's own network namespace: on loopback, the pod's address
        args = [pod.ip if arg == "0.0.0.0" and i and args[i - 1] == "--host" else arg for i, arg in enumerate(args)]
        if "command" in container:
            return [_kube_expand(part, env) for part in container["command"]] + args
        assert container["image"].split(":")[0].endswith("redis"), container["image"]
        return [REDIS_SERVER, *args, "--bind", pod.ip, "127.0.0.1"]  # the redis image's entrypoint

    def start(self) -> None:
        if not self.image_root:
            _build_image_kernels()
        for pod in self.pods.values():
            for container in pod.spec["containers"]:
                directory = self.workdir / pod.name / container["name"]
                directory.mkdir(parents=True, exist_ok=True)
                env = self._env(pod, container)
                sandbox = self._sandbox(pod, container, directory)
                pod.sandboxes[container["name"]], pod.envs[container["name"]] = sandbox, env
                with open(directory / "log", "wb") as log:
                    pod.processes.append(subprocess.Popen([*sandbox, "--", *self._command(pod, container, env)],
                                                          env=env, stdout=log, stderr=subprocess.STDOUT,
                                                          start_new_session=True))

    # ---- probes ------------------------------------------------------------------------------------------------

    def _probe(self, pod: Pod, container: dict, probe: dict) -> bool:
        timeout = probe.get("timeoutSeconds", 1)
        try:
            if "grpc" in probe:
                with grpc.insecure_channel(f"{pod.ip}:{probe['grpc']['port']}") as channel:
                    answer = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")), timeout=timeout)
                return answer.status == health_pb2.HealthCheckResponse.SERVING
            if "tcpSocket" in probe:
                with socket.create_connection((pod.ip, pod.container_port(probe["tcpSocket"]["port"])), timeout):
                    return True
            if "httpGet" in probe:
                get = probe["httpGet"]
                url = f"http://{pod.ip}:{pod.container_port(get['port'])}{get.get('path', '/')}"
                with urllib.request.urlopen(url, timeout=timeout) as answer:
                    return 200 <= answer.status < 400
            if "exec" in probe:
                sandbox = pod.sandboxes[container["name"]]
                return subprocess.run([*sandbox, "--", *probe["exec"]["command"]], env=pod.envs[container["name"]],
                                      capture_output=True, timeout=max(timeout, 5)).returncode == 0
        except (OSError, grpc.RpcError, subprocess.TimeoutExpired):
            return False
        raise NotImplementedError(f"{pod.name}: probe {probe}")

    def wait_ready(self, timeout_s: float) -> None:
        """Every container's startup probe (if any) and then its readiness probe pass, or an error with the logs."""
        deadline = time.monotonic() + timeout_s
        waiting = [(pod, c, kind) for pod in self.pods.values() for c in pod.spec["containers"]
                   for kind in ("startupProbe", "readinessProbe") if kind in c]
        while waiting:
            pod, container, kind = waiting[0]
            dead = [p for p in pod.processes if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{pod.name} {kind}: {'exited' if dead else 'not passing'}\n{self.logs()}")
            if self._probe(pod, container, container[kind]):
                waiting.pop(0)
            else:
                time.sleep(0.5)

    def logs(self) -> str:
        return "\n".join(f"--- {path.parent.relative_to(self.workdir)}\n{path.read_text(errors='replace')[-3000:]}"
                         for path in sorted(self.workdir.glob("*/*/log")))

    def stop(self) -> None:
        processes = [(p, pod) for pod in self.pods.values() for p in pod.processes if p.poll() is None]
        for process, _ in processes:
            os.killpg(process.pid, signal.SIGTERM)
        for process, pod in processes:
            try:
                process.wait(timeout=pod.spec.get("terminationGracePeriodSeconds", 30))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


# ---- cert-manager's Secret ------------------------------------------------------------------------------------

def _certificate(subject: str, issuer: str, public_key, signing_key, extensions) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
               .public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(signing_key, hashes.SHA256())


def write_tls_secret(directory: Path, names: list[str]) -> Path:
    """``directory`` holding tls.crt, tls.key and ca.crt; ``names``: DNS names or IP addresses the leaf lists."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("splitserve test CA", "splitserve test CA", ca_key.public_key(), ca_key,
                      [(x509.BasicConstraints(ca=True, path_length=None), True)])
    alt_names = []
    for name in names:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt_names.append(x509.DNSName(name))
    leaf = _certificate(names[0], "splitserve test CA", key.public_key(), ca_key, [
        (x509.SubjectAlternativeName(alt_names), False),
        (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), False)])
    pem = serialization.Encoding.PEM
    (directory / "ca.crt").write_bytes(ca.public_bytes(pem))
    (directory / "tls.crt").write_bytes(leaf.public_bytes(pem))
    (directory / "tls.key").write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    return directory
