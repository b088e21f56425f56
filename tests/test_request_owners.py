"""One owner per request (issue 44): the objects that decide return decisions; the object that runs the request holds
its state.

- ``Placement`` (router/placement.py) decides and does nothing else: it imports no gRPC stub, no pod client and no
  protocol message, and awaits nothing;
- a ``RequestRun``'s fields (and those of the objects it owns, ``run.output``, ``run.calls``) are written in
  router/request_run.py alone, and ``Router`` writes no field but its own;
- a request's trip through the real router (fake pods on loopback) enters placement.py once per decision: admit and
  route for a request that goes through; a retry adds a retry and a route, a migration an after_break and a
  migration_target;
- the decode pod's server reaches the lease table only through the hand-off (kvtransfer/handoff.py, ``KVHandoff``):
  it names no lease, no state and no lease field; and no module but the hand-off writes a lease's fields.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import sys
from pathlib import Path


from tests.test_router_flow import LONG_PROMPT, first_prefill_pod_broken, generate_all, run, running_cluster
from tests.test_structure import code_files, imported_names

REPO = Path(__file__).resolve().parents[1]
PLACEMENT = REPO / "router" / "placement.py"
REQUEST_RUN = REPO / "router" / "request_run.py"
HANDOFF = REPO / "kvtransfer" / "handoff.py"
DECODE_SERVER = REPO / "decode_service" / "server.py"


# ---- Placement decides ----------------------------------------------------------------------------------------------

def pod_calling_names(path: Path, module: str) -> list[str]:
    """What in ``path`` would let it call a pod: gRPC stubs and messages, the pod client, grpc.aio, asyncio."""
    found = [name for name in imported_names(path, module)
             if name.endswith(("_pb2", "_pb2_grpc")) or name.startswith(("splitserve.v1", "grpc.aio", "asyncio"))
             or name == "splitserve.router.pods.client"]
    tree = ast.parse(path.read_text())
    found += [f"line {node.lineno}: {type(node).__name__}" for node in ast.walk(tree)
              if isinstance(node, (ast.AsyncFunctionDef, ast.Await, ast.AsyncFor, ast.AsyncWith))]
    return found


def test_placement_imports_no_grpc_stub_and_calls_no_pod():
    assert pod_calling_names(PLACEMENT, "splitserve.router.placement") == []


def test_the_check_finds_a_stub_and_an_await(tmp_path):
    module = tmp_path / "placement.py"
    module.write_text("from splitserve.v1 import decode_pb2_grpc\nimport grpc\n\n"
                      "async def start(stub):\n    return await stub.Decode()\n")
    assert pod_calling_names(module, "pkg.placement") == [
        "splitserve.v1", "splitserve.v1.decode_pb2_grpc", "line 4: AsyncFunctionDef", "line 5: Await"]


# ---- the run owns its state -----------------------------------------------------------------------------------------

def _root(target: ast.expr) -> str | None:
    """The name an attribute target hangs off (``run`` for ``run.output.first_token_at``), if it is one."""
    if not isinstance(target, ast.Attribute):
        return None
    while isinstance(target, ast.Attribute):
        target = target.value
    return target.id if isinstance(target, ast.Name) else None


def attribute_writes(source: str) -> list[tuple[int, str, str]]:
    """(line, root name, target) of every attribute written (assigned, augmented, deleted, or set with ``setattr``)."""
    writes = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple)
                                                              else [target])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            targets = [ast.Attribute(value=node.args[0], attr="?")] if node.args else []
        writes += [(node.lineno, root, ast.unparse(target)) for target in targets if (root := _root(target))]
    return writes


def run_writes_outside_the_run() -> list[str]:
    """Writes to ``run.`` (a ``RequestRun``, and what hangs off it) anywhere in the tree, tests included, outside
    router/request_run.py."""
    files = [path for path in code_files() if path != REQUEST_RUN]
    files += sorted((REPO / "tests").rglob("*.py"))
    return [f"{path.relative_to(REPO)}:{line}: {target}" for path in files
            for line, root, target in attribute_writes(path.read_text()) if root == "run"]


def test_only_the_request_run_writes_a_runs_fields():
    assert run_writes_outside_the_run() == []


def test_the_router_writes_no_field_but_its_own():
    writes = attribute_writes((REPO / "router" / "router.py").read_text())
    assert [f"{line}: {target}" for line, root, target in writes if root != "self"] == []


def test_the_write_check_finds_every_way_to_write_a_field():
    source = ("run.aborted = True\nrun.output.cached_tokens += 1\nrun.x, other = 1, 2\ndel run.calls\n"
              "setattr(run, 'migrations', 3)\nrun.kv_sent_to.append(pod)\nself.runs = {}\n")
    assert [(line, target) for line, root, target in attribute_writes(source) if root == "run"] == [
        (1, "run.aborted"), (2, "run.output.cached_tokens"), (3, "run.x"), (4, "run.calls"), (5, "run.?")]


# ---- a trip enters placement.py once per decision -------------------------------------------------------------------

@contextlib.contextmanager
def placement_entries():
    """The placement.py functions entered from outside the file while the block runs, and how often."""
    entered: collections.Counter = collections.Counter()
    placement_file = str(PLACEMENT)

    def profile(frame, event, _arg):
        if event == "call" and frame.f_code.co_filename == placement_file:
            caller = frame.f_back
            if caller is None or caller.f_code.co_filename != placement_file:
                entered[frame.f_code.co_name] += 1

    sys.setprofile(profile)
    try:
        yield entered
    finally:
        sys.setprofile(None)


def test_a_requests_trip_enters_placement_once_per_decision():
    async def scenario():
        async with running_cluster() as env:
            with placement_entries() as entered:
                _, _, done = await generate_all(env.router, LONG_PROMPT, max_tokens=5)
            assert done.finish_reason == "length"
            assert entered == {"admit": 1, "route": 1}
    run(scenario())


def test_a_retry_and_a_migration_each_enter_placement_once_per_decision():
    async def retried():
        async with running_cluster(num_prefill=2) as env:
            await first_prefill_pod_broken(env)
            with placement_entries() as entered:
                _, _, done = await generate_all(env.router, LONG_PROMPT, max_tokens=4)
            assert done.finish_reason == "length"
            assert entered == {"admit": 1, "route": 2, "retry": 1}

    async def migrated():
        async with running_cluster(num_decode=2) as env:
            first_d, _ = sorted(env.decode, key=lambda pod: pod.address)  # least_loaded's first choice
            first_d.fail_after_tokens = 3
            with placement_entries() as entered:
                _, _, done = await generate_all(env.router, LONG_PROMPT, max_tokens=10)
            assert done.finish_reason == "length"
            assert entered == {"admit": 1, "route": 1, "after_break": 1, "migration_target": 1}

    run(retried())
    run(migrated())


# ---- the decode hand-off owns its leases ----------------------------------------------------------------------------

def lease_table_names(source: str) -> list[str]:
    """What in ``source`` reaches into the lease table: the lease and state types, a lease's own fields (but
    ``request_id`` and ``seq``, which other objects have too), the table's private dict."""
    from splitserve.kvtransfer.handoff import KVLease

    fields = {name for name in KVLease.__dataclass_fields__ if name not in ("request_id", "seq")}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and (node.attr in fields or node.attr == "_leases"):
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, (ast.Name, ast.alias)) and getattr(node, "id", getattr(node, "name", "")) in (
                "KVLease", "TransferState"):
            found.append(f"{node.lineno}: {getattr(node, 'id', getattr(node, 'name', ''))}")
    return found


def test_the_decode_server_reaches_the_leases_only_through_the_handoff():
    kvtransfer = [name for name in imported_names(DECODE_SERVER, "splitserve.decode_service.server")
                  if name.startswith("splitserve.kvtransfer.") and name.count(".") == 2]
    assert sorted(kvtransfer) == ["splitserve.kvtransfer.handoff", "splitserve.kvtransfer.receiver",
                                  "splitserve.kvtransfer.shm"]
    assert lease_table_names(DECODE_SERVER.read_text()) == []


def test_only_the_handoff_writes_a_leases_fields():
    files = [path for path in code_files() if path != HANDOFF]
    writes = [f"{path.relative_to(REPO)}:{line}: {target}" for path in files
              for line, root, target in attribute_writes(path.read_text()) if root == "lease"]
    assert writes == []


def test_the_lease_check_sees_a_state_change_and_a_lease_type():
    source = "from splitserve.kvtransfer.handoff import TransferState\nlease.claims_left -= 1\nx = lease.seq\n"
    assert lease_table_names(source) == ["1: TransferState", "2: .claims_left"]
