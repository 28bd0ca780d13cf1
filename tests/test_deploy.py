"""The deployment files under deploy/ against the code they run: every container's command (its shell
script run for real, with the programs it starts replaced by stubs that record their argv) parsed
by the real CLI parsers; probe ports, metrics annotations, health service names, Services, volumes
and the router's shard-server list checked against the commands; and deploy/sync_shards.py, the
shard servers' init container, on a real index."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rest_spec.build_index.__main__ import _parser as build_index_parser
from rest_spec.datastore.__main__ import build_parser as datastore_parser
from rest_spec.datastore.client import DatastoreClient
from rest_spec.datastore.format import MANIFEST, read_manifest
from rest_spec.datastore.index import Datastore
from rest_spec.datastore.server import SERVICE_NAME
from rest_spec.datastore.shards import SERVICE_NAME as SHARD_SERVICE_NAME
from rest_spec.datastore.shards import parse_shard_spec
from tests.helpers import CORPUS_VOCAB, DatastoreProcess, contexts_from, synthetic_corpus, write_index

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SYNC_SCRIPT = DEPLOY / "sync_shards.py"
SYNC_IN_IMAGE = "/opt/rest-spec/sync_shards.py"
PROGRAMS = ("rest-datastore", "build_index", "python")


def _load_sync_module():
    spec = importlib.util.spec_from_file_location("sync_shards", SYNC_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documents() -> list[tuple[str, dict]]:
    """Every YAML document under deploy/, with its file's name."""
    docs = []
    for path in sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")]):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return docs


DOCS = documents()


@dataclass
class Pod:
    """A pod template of a workload (``kind``, ``name``): its spec, labels and annotations."""

    kind: str
    name: str
    spec: dict
    labels: dict
    annotations: dict
    workload: dict


def pods() -> list[Pod]:
    found = []
    for _, doc in DOCS:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind in ("Deployment", "StatefulSet"):
            templates = [doc["spec"]["template"]]
        elif kind == "RayJob":
            cluster = doc["spec"]["rayClusterSpec"]
            templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
        else:
            continue
        for template in templates:
            meta = template.get("metadata", {})
            found.append(Pod(kind, name, template["spec"], meta.get("labels", {}), meta.get("annotations", {}), doc))
    return found


POD_TEMPLATES = pods()


def of_kind(kind: str) -> list[dict]:
    return [doc for _, doc in DOCS if doc["kind"] == kind]


def stub_dir(tmp_path: Path) -> Path:
    """A directory of stand-ins for the programs a container starts: each writes its argv,
    NUL-separated, to $ARGV_FILE and exits."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for program in PROGRAMS:
        stub = bin_dir / program
        stub.write_text('#!/bin/sh\nprintf \'%s\\0\' "$(basename "$0")" "$@" > "$ARGV_FILE"\n')
        stub.chmod(0o755)
    return bin_dir


def container_argv(container: dict, pod_name: str, tmp_path: Path) -> list[str]:
    """The argv of the program ``container`` runs in the pod named ``pod_name``: a ``sh -c`` script
    is run with the container's env and HOSTNAME, the programs it starts being stubs."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if argv[:2] != ["/bin/sh", "-c"]:
        return argv
    assert len(argv) == 3, f"{container['name']}: sh -c takes one script"
    argv_file = tmp_path / "argv"
    argv_file.unlink(missing_ok=True)
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    env.update(PATH=f"{stub_dir(tmp_path)}:/usr/bin:/bin", HOSTNAME=pod_name, ARGV_FILE=str(argv_file))
    proc = subprocess.run(["/bin/sh", "-c", argv[2]], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"{container['name']}'s script failed: {proc.stderr}"
    return argv_file.read_text().split("\0")[:-1]


def parser_problems(parser: argparse.ArgumentParser, args: list[str], where: str) -> list[str]:
    """What ``parser`` finds wrong with ``args``: flags it does not define, else its own refusal."""
    known = {option for action in parser._actions for option in action.option_strings}
    unknown = [a.split("=")[0] for a in args if a.startswith("--") and a.split("=")[0] not in known]
    if unknown:
        return [f"{where}: {parser.prog} has no flag {', '.join(unknown)}"]
    message = io.StringIO()
    try:
        with contextlib.redirect_stderr(message):
            parser.parse_args(args)
    except SystemExit:
        return [f"{where}: {message.getvalue().strip().splitlines()[-1]} ({shlex.join(args)})"]
    return []


def datastore_problems(args: list[str], where: str) -> list[str]:
    (action,) = [a for a in datastore_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    if args[0] not in action.choices:
        return [f"{where}: rest-datastore has no subcommand {args[0]!r} (it has {', '.join(action.choices)})"]
    return parser_problems(action.choices[args[0]], args[1:], where)


def flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def statefulset_pod_names(pod: Pod) -> list[str]:
    if pod.kind == "StatefulSet":
        return [f"{pod.name}-{i}" for i in range(pod.workload["spec"]["replicas"])]
    return [f"{pod.name}-7d4b9c-x2x9z"]  # a Deployment's pod name: never read by its command


def commands(tmp_path: Path) -> list[tuple[Pod, dict, str, list[str]]]:
    """(pod, container, pod name, argv) of every container that names its command, per replica."""
    found = []
    for pod in POD_TEMPLATES:
        for container in pod.spec.get("initContainers", []) + pod.spec["containers"]:
            if "command" not in container and "args" not in container:
                continue  # KubeRay's Ray containers: KubeRay starts them
            for pod_name in statefulset_pod_names(pod):
                found.append((pod, container, pod_name, container_argv(container, pod_name, tmp_path)))
    for job in of_kind("RayJob"):
        found.append((None, None, job["metadata"]["name"], shlex.split(job["spec"]["entrypoint"])))
    return found


@pytest.fixture(scope="module")
def all_commands(tmp_path_factory):
    return commands(tmp_path_factory.mktemp("deploy"))


def test_deploy_has_the_workloads():
    kinds = {(source, doc["kind"]) for source, doc in DOCS}
    assert {("shard-server.yaml", "StatefulSet"), ("shard-server.yaml", "Service")} <= kinds
    assert {("router.yaml", "Deployment"), ("router.yaml", "Service"), ("build-rayjob.yaml", "RayJob")} <= kinds


def test_every_command_runs_a_real_program_with_real_flags(all_commands):
    programs, problems = set(), []
    for _, container, pod_name, argv in all_commands:
        where = f"{pod_name}/{container['name'] if container else 'entrypoint'}"
        program = PurePosixPath(argv[0]).name
        programs.add(program)
        if program == "rest-datastore":
            problems += datastore_problems(argv[1:], where)
        elif program == "build_index":
            problems += parser_problems(build_index_parser(), argv[1:], where)
        elif program == "python" and argv[1] == SYNC_IN_IMAGE:
            problems += parser_problems(_load_sync_module()._parser(), argv[2:], where)
        else:
            problems.append(f"{where}: runs {shlex.join(argv[:2])}, not a program of the image")
    assert programs == set(PROGRAMS)
    assert not problems, "\n".join(problems)


def test_probes_ports_and_health_services_match_the_commands(all_commands):
    servers = [(pod, c, argv) for pod, c, _, argv in all_commands if c and argv[0] == "rest-datastore"]
    assert {argv[1] for _, _, argv in servers} == {"serve", "route"}
    for pod, container, argv in servers:
        where = f"{pod.name}/{container['name']}"
        port = int(flag(argv, "--port"))
        assert {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"] == port, where
        shard_server = argv[1] == "serve" and flag(argv, "--shards") is not None
        # a shard server serves only the internal shard service
        services = {"", SHARD_SERVICE_NAME} if shard_server else {"", SERVICE_NAME}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            check = container[probe]["grpc"]
            assert check["port"] == port, f"{where}: {probe} on port {check['port']}, the server on {port}"
            assert check.get("service", "") in services, f"{where}: {probe} asks for {check.get('service')!r}"


def test_metrics_annotations_match_the_metrics_port(all_commands):
    servers = [(pod, c, argv) for pod, c, _, argv in all_commands if c and argv[0] == "rest-datastore"]
    for pod, container, argv in servers:
        where = f"{pod.name}/{container['name']}"
        metrics_port = flag(argv, "--metrics-port")
        assert metrics_port is not None, f"{where}: no --metrics-port"
        assert pod.annotations["prometheus.io/scrape"] == "true", where
        assert pod.annotations["prometheus.io/port"] == metrics_port, where
        assert pod.annotations["prometheus.io/path"] == "/metrics", where
        assert {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"] == int(metrics_port), where
        assert container["resources"]["requests"], where


def test_shard_servers_cover_every_shard_once_and_sync_what_they_serve(all_commands):
    """Per ordinal: the init container copies exactly the shards the server serves, to the index
    it opens; together the ordinals serve shards 0..n-1, each once, in order."""
    (statefulset,) = of_kind("StatefulSet")
    by_pod: dict[str, dict[str, list[str]]] = {}
    for pod, container, pod_name, argv in all_commands:
        if pod is not None and pod.kind == "StatefulSet":
            by_pod.setdefault(pod_name, {})[container["name"]] = argv
    served = []
    for i in range(statefulset["spec"]["replicas"]):
        argvs = by_pod[f"{statefulset['metadata']['name']}-{i}"]
        sync = next(argv for argv in argvs.values() if argv[0] == "python")
        serve = next(argv for argv in argvs.values() if argv[0] == "rest-datastore")
        assert flag(serve, "--shards") == flag(sync, "--shards"), f"ordinal {i}"
        assert flag(serve, "--index") == flag(sync, "--dest"), f"ordinal {i}: serves what it synced"
        served += parse_shard_spec(flag(serve, "--shards"))
    assert served == list(range(len(served)))


def test_router_lists_every_shard_server(all_commands):
    (statefulset,) = of_kind("StatefulSet")
    name, service = statefulset["metadata"]["name"], statefulset["spec"]["serviceName"]
    shard_port = next(
        flag(argv, "--port")
        for pod, _, _, argv in all_commands
        if pod and pod.kind == "StatefulSet" and argv[0] != "python"
    )
    (router,) = {tuple(argv) for _, c, _, argv in all_commands if c and argv[:2] == ["rest-datastore", "route"]}
    servers = flag(list(router), "--shard-servers").split(",")
    assert servers == [f"{name}-{i}.{service}:{shard_port}" for i in range(statefulset["spec"]["replicas"])]
    assert service in {s["metadata"]["name"] for s in of_kind("Service") if s["spec"].get("clusterIP") == "None"}


def test_services_select_pods_and_name_their_ports():
    for service in of_kind("Service"):
        name = service["metadata"]["name"]
        selected = [p for p in POD_TEMPLATES if service["spec"]["selector"].items() <= p.labels.items()]
        assert selected, f"Service {name} selects no pod"
        for pod in selected:
            port_names = {p["name"] for c in pod.spec["containers"] for p in c.get("ports", [])}
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in port_names, f"Service {name}: no container port {port['targetPort']}"


def test_paths_lie_on_mounted_volumes(all_commands):
    claims = {pvc["metadata"]["name"] for pvc in of_kind("PersistentVolumeClaim")}
    for pod, container, pod_name, argv in all_commands:
        if pod is None:
            continue
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        volumes.update({t["metadata"]["name"]: t for t in pod.workload["spec"].get("volumeClaimTemplates", [])})
        mounts = container.get("volumeMounts", [])
        for mount in mounts:
            assert mount["name"] in volumes, f"{pod_name}: mount of an undefined volume {mount['name']}"
            claim = volumes[mount["name"]].get("persistentVolumeClaim")
            assert claim is None or claim["claimName"] in claims, f"{pod_name}: no claim {claim}"
        for option in ("--index", "--manifest", "--source", "--dest"):
            path = flag(argv, option)
            if path is not None:
                assert any(PurePosixPath(path).is_relative_to(m["mountPath"]) for m in mounts), f"{pod_name}: {path}"


def test_rayjob_builds_onto_the_shared_volume_with_a_memory_backed_shm():
    (job,) = of_kind("RayJob")
    out = flag(shlex.split(job["spec"]["entrypoint"]), "--out")
    router_manifest = flag(
        next(c["args"] for p in POD_TEMPLATES if p.kind == "Deployment" for c in p.spec["containers"]),
        "--manifest",
    )
    assert router_manifest == f"{out}/{MANIFEST}"  # the router reads what the build writes
    for pod in (p for p in POD_TEMPLATES if p.kind == "RayJob"):
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        (container,) = pod.spec["containers"]
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
        assert PurePosixPath(out).is_relative_to("/data") and mounts["/data"]["persistentVolumeClaim"]["claimName"]


def test_image_and_dockerfile():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    images = {c["image"] for p in POD_TEMPLATES for c in p.spec.get("initContainers", []) + p.spec["containers"]}
    assert images == {f"ghcr.io/rest-spec/rest-spec:{version}"}
    assert dockerfile.startswith("#") and "\nFROM python:3.11-slim\n" in dockerfile
    assert f"COPY deploy/sync_shards.py {SYNC_IN_IMAGE}" in dockerfile
    assert "--index-url https://download.pytorch.org/whl/cpu" in dockerfile
    # BuildKit sends only what deploy/Dockerfile.dockerignore lets through: everything COPY names
    allowed = {
        line[1:] for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines() if line.startswith("!")
    }
    sources = [src for line in dockerfile.splitlines() if line.startswith("COPY ") for src in line.split()[1:-1]]
    assert sources and all(src in allowed for src in sources), set(sources) - allowed


# ---- the deployment, run on this machine -------------------------------------------------------


def local_path(path: str, container: dict, pod: Pod, pod_name: str, root: Path) -> Path:
    """Where ``path`` of ``container`` lies on this machine: each volume is a directory under
    ``root`` -- a claim one directory for every pod that mounts it, a claim template one per pod."""
    volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if PurePosixPath(path).is_relative_to(mount["mountPath"]):
            claim = volumes.get(mount["name"], {}).get("persistentVolumeClaim")
            volume = root / "claims" / claim["claimName"] if claim else root / "pods" / pod_name / mount["name"]
            return volume / PurePosixPath(path).relative_to(mount["mountPath"])
    raise AssertionError(f"{pod_name}/{container['name']}: {path} is on no volume")


def on_loopback(argv: list[str], container: dict, pod: Pod, pod_name: str, root: Path) -> list[str]:
    """``argv`` as this machine runs it: loopback, free ports, volumes as directories under ``root``."""
    local = {"--host": "127.0.0.1", "--port": "0", "--metrics-port": "0"}
    out = []
    for i, arg in enumerate(argv):
        before = argv[i - 1] if i else ""
        if before in local:
            arg = local[before]
        elif before in ("--index", "--manifest", "--source", "--dest"):
            arg = str(local_path(arg, container, pod, pod_name, root))
        out.append(arg)
    return out


@pytest.mark.server
def test_the_deployment_runs_on_loopback(all_commands, tmp_path):
    """The files' own commands, run as processes here: the build's output on the shared volume,
    each shard server's init container syncing its shards to its own disk and the server serving
    them, a router over all of them; every probe's health service answers SERVING and the router
    drafts what the whole index drafts."""
    (statefulset,) = of_kind("StatefulSet")
    shard_argvs = [(pod, c, name, argv) for pod, c, name, argv in all_commands if pod and pod.kind == "StatefulSet"]
    num_shards = sum(len(parse_shard_spec(flag(a, "--shards"))) for _, _, _, a in shard_argvs if a[0] != "python")
    (job,) = of_kind("RayJob")
    build_out = PurePosixPath(flag(shlex.split(job["spec"]["entrypoint"]), "--out"))
    (router_pod,) = [p for p in POD_TEMPLATES if p.kind == "Deployment"]
    router_container = router_pod.spec["containers"][0]
    # what the build leaves on the shared volume (the router reads it where it mounts the claim)
    docs = synthetic_corpus()
    shard_tokens = -(-sum(map(len, docs)) // num_shards) + max(map(len, docs))
    published = local_path(str(build_out), router_container, router_pod, "router", tmp_path)
    write_index(published, docs, CORPUS_VOCAB, shard_tokens=shard_tokens)
    assert len(read_manifest(published).shards) == num_shards

    servers = []
    try:
        for pod, container, pod_name, argv in shard_argvs:
            argv = on_loopback(argv, container, pod, pod_name, tmp_path)
            if argv[0] == "python":  # the init container, which runs to completion first
                proc = subprocess.run([sys.executable, str(SYNC_SCRIPT), *argv[2:]], capture_output=True, text=True)
                assert proc.returncode == 0, f"{pod_name}/{container['name']}: {proc.stderr}"
            else:
                servers.append((container, DatastoreProcess(*argv[1:])))
        for _, server in servers:
            assert server.wait().address, server.output
        (router_argv,) = {tuple(a) for p, c, _, a in all_commands if c is router_container}
        router_argv = on_loopback(list(router_argv), router_container, router_pod, "router", tmp_path)
        router_argv[router_argv.index("--shard-servers") + 1] = ",".join(s.address for _, s in servers)
        router = DatastoreProcess(*router_argv[1:])
        servers.append((router_container, router))
        assert router.wait().address, router.output

        for container, server in servers:
            with grpc.insecure_channel(server.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    request = health_pb2.HealthCheckRequest(service=container[probe]["grpc"].get("service", ""))
                    assert stub.Check(request, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        contexts = contexts_from(docs, 20)
        with DatastoreClient(router.address) as client, Datastore.open(published) as whole:
            assert client.draft_batch(contexts) == [whole.draft(c) for c in contexts]
    finally:
        for _, server in servers:
            server.stop()
    assert len(servers) == statefulset["spec"]["replicas"] + 1


# ---- deploy/sync_shards.py ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def source_index(tmp_path_factory):
    index = write_index(
        tmp_path_factory.mktemp("source") / "index", synthetic_corpus(), CORPUS_VOCAB, shard_tokens=2_000
    )
    assert len(read_manifest(index).shards) >= 4
    return index


def sync(source: Path, dest: Path, spec: str) -> subprocess.CompletedProcess:
    args = ["--source", source, "--dest", dest, "--shards", spec]
    return subprocess.run(
        [sys.executable, str(SYNC_SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120
    )


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_sync_copies_the_shards_and_the_manifest(source_index, tmp_path):
    dest = tmp_path / "data" / "index"
    proc = sync(source_index, dest, "1-2")
    assert proc.returncode == 0, proc.stderr
    manifest = read_manifest(dest)
    assert manifest == read_manifest(source_index)
    wanted = {MANIFEST} | {f.name for s in manifest.shards[1:3] for f in s.files.values()}
    assert set(digests(dest)) == wanted  # no temporary file left
    source = digests(source_index)
    assert all(source[name] == digest for name, digest in digests(dest).items())
    assert "2 shards in" in proc.stderr and "4 files copied, 0 already in place" in proc.stderr

    again = sync(source_index, dest, "1-2")  # a restarted pod copies nothing
    assert again.returncode == 0 and "0 files copied, 4 already in place" in again.stderr
    with Datastore.open(dest, shards=[1, 2]) as store:  # what the shard server opens
        assert store.shard_numbers == (1, 2)


def test_sync_replaces_a_damaged_local_file(source_index, tmp_path):
    dest = tmp_path / "index"
    assert sync(source_index, dest, "0").returncode == 0
    sa = read_manifest(dest).shards[0].files["sa"].name
    data = bytearray((dest / sa).read_bytes())
    data[-1] ^= 0xFF
    (dest / sa).write_bytes(bytes(data))
    proc = sync(source_index, dest, "0")
    assert proc.returncode == 0 and "1 files copied, 1 already in place" in proc.stderr
    assert digests(dest)[sa] == digests(source_index)[sa]


def test_sync_refuses_shards_outside_the_index(source_index, tmp_path):
    n = len(read_manifest(source_index).shards)
    proc = sync(source_index, tmp_path / "index", f"{n - 1}-{n}")
    assert proc.returncode == 1
    assert f"{source_index}: shard {n} is not in the index (its shards are 0..{n - 1})" in proc.stderr
    assert not (tmp_path / "index").exists()


def test_sync_refuses_a_source_that_does_not_match_its_manifest(source_index, tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for path in source_index.iterdir():
        (source / path.name).write_bytes(path.read_bytes())
    name = read_manifest(source).shards[1].files["tokens"].name
    data = bytearray((source / name).read_bytes())
    data[len(data) // 2 :] = b"\0" * (len(data) - len(data) // 2)  # the spot digest covers the tail
    (source / name).write_bytes(bytes(data))
    dest = tmp_path / "index"
    assert sync(source, dest, "0").returncode == 0  # shard 0 is intact
    proc = sync(source, dest, "1")
    assert proc.returncode == 1 and f"{source / name} does not match the manifest" in proc.stderr
    assert not (dest / MANIFEST).exists()  # a server refuses the half-synced directory
    assert not [p for p in dest.iterdir() if p.name.endswith(".part")]


def test_sync_refuses_a_source_that_is_no_index_and_a_bad_spec(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / MANIFEST).write_text(json.dumps({"format": "something else"}))
    proc = sync(tmp_path / "src", tmp_path / "index", "0")
    assert proc.returncode == 1 and proc.stderr.startswith("sync_shards: error: ")
    usage = sync(tmp_path / "src", tmp_path / "index", "3-1")
    assert usage.returncode == 2 and "the range 3-1 is empty" in usage.stderr


def test_sync_runs_where_the_image_puts_it():
    """The script imports only the installed package: it runs from any directory."""
    proc = subprocess.run(
        [sys.executable, str(SYNC_SCRIPT), "--help"],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=60,
        env=os.environ,
    )
    assert proc.returncode == 0 and "--shards SPEC" in proc.stdout
