"""``rest-datastore``: serve an index over gRPC, describe or verify it, draft from it by hand.

    rest-datastore serve  --index DIR [--index DIR ...] [--host 127.0.0.1] [--port 50051] [--workers 8]
                          [--outputs-max-tokens 1000000] [--outputs-dir DIR] [--outputs-salvage] [--check-index]
                          [--max-context-tokens N] [--max-batch-contexts N] [--max-request-bytes N]
                          [--max-reply-bytes N] [--max-concurrent-rpcs N]
                          [--tls-cert PEM --tls-key PEM] [--auth-token T | --auth-token-file F]
                          [--auth-scope add-output|all]
    rest-datastore serve  --index DIR --shards 0-3,7 [...]    (a shard server: the internal shard service only)
    rest-datastore route  --manifest DIR/manifest.json --shard-servers H:P,H:P [--shard-timeout S]
                          [--allow-partial] [--shard-tls-ca PEM] [--shard-auth-token T] [serve's flags but
                          --index, --check-index, --shards]
    rest-datastore info   --index DIR [...] | --server HOST:PORT [--tls-ca PEM] [--auth-token T]
    rest-datastore verify --index DIR [...]
    rest-datastore draft  --index DIR [...] | --server HOST:PORT  --tokens 1,2,3 | --text "..." [--tokenizer SPEC]

Several --index flags (or one comma-separated list, also in $REST_INDEX) open their indexes as one
datastore (``Datastore.open`` of the list): the same trees as one index of all their shards.

Exit statuses, as every rest-spec command's: 2 for a usage error (argparse's own, a missing --index,
a flag value the configs refuse: with the usage line), 1 for a failure (a missing or corrupt index,
an unreachable server, a refused call, a port in use: one line on stderr), 130 for Ctrl-C.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

# gRPC's C core would log a failed bind itself, before our one-line error; it reads this when grpc
# is first imported, so it is set before the imports below (GRPC_VERBOSITY=debug still wins)
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from rest_spec.common.cli import exit_statuses, first_line, run_command, setup_logging  # noqa: E402
from rest_spec.common.errors import UsageError  # noqa: E402
from rest_spec.common.logs import LOG_FORMATS  # noqa: E402
from rest_spec.common.tokenizer import SMOLLM2_GGUF, check_tokenizer, load_tokenizer, tokenizer_fingerprint  # noqa: E402
from rest_spec.common.types import DEFAULT_CONFIG, DraftConfig, DraftTree  # noqa: E402
from rest_spec.datastore.client import DatastoreClient, add_connection_arguments  # noqa: E402
from rest_spec.datastore.index import Datastore, index_paths  # noqa: E402
from rest_spec.datastore.router import RouterConfig, route  # noqa: E402
from rest_spec.datastore.rpc import AUTH_SCOPES, ServerConfig  # noqa: E402
from rest_spec.datastore.server import serve  # noqa: E402
from rest_spec.datastore.shards import parse_shard_spec, serve_shards  # noqa: E402

DEFAULT_SERVER = ServerConfig()
EXIT_STATUSES = exit_statuses(
    ("index missing or corrupt", "server unreachable", "call refused", "port in use"),
    usage=("an unknown flag", "a missing --index", "a value out of range"),
)
# What the index, the connections, the tokenizer and the requests raise for a problem to report.
FAILURES = (OSError, ValueError, RuntimeError)


def _flag_values(make, **values):
    """``make(**values)``, a config built from flag values: a value it refuses is a usage error."""
    try:
        return make(**values)
    except ValueError as exc:
        raise UsageError(first_line(exc)) from None


def _token_list(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if not tokens:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return tokens


def _env_flag(name: str) -> bool:
    """A boolean environment variable: set to anything but "", 0, false or no."""
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


INDEX_HELP = (
    "index directory; several (the flag repeated, or comma-separated) answer as one index of all their "
    "shards (default: $REST_INDEX)"
)


def _add_index(parser) -> None:
    parser.add_argument("--index", action="append", metavar="DIR", help=INDEX_HELP)


def _add_source(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    _add_index(group)
    group.add_argument("--server", metavar="HOST:PORT", help="a running `rest-datastore serve`")
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for --server (default: %(default)s)"
    )
    add_connection_arguments(parser, "--server")


def _add_server_arguments(cmd: argparse.ArgumentParser) -> None:
    """The flags of every server command: where to listen, limits, exposure, the output store."""
    env = os.environ.get
    cmd.add_argument(
        "--host",
        default=env("REST_HOST", DEFAULT_SERVER.host),
        help="address to bind (default: $REST_HOST or %(default)s)",
    )
    cmd.add_argument(
        "--port",
        type=int,
        default=env("REST_PORT", str(DEFAULT_SERVER.port)),
        help="0 picks a free port (default: $REST_PORT or %(default)s)",
    )
    cmd.add_argument(
        "--workers",
        type=int,
        default=env("REST_WORKERS", str(DEFAULT_SERVER.workers)),
        help="request threads (default: $REST_WORKERS or %(default)s)",
    )
    limits = cmd.add_argument_group(
        "limits per call",
        "what one call may ask for; beyond them it is refused with INVALID_ARGUMENT or "
        "RESOURCE_EXHAUSTED naming the limit. The defaults keep a small machine responsive under hostile clients.",
    )
    for flag, help_text in (
        ("--max-context-tokens", "tokens in one context"),
        ("--max-batch-contexts", "contexts in one DraftBatch"),
        ("--max-request-bytes", "bytes of one request message"),
        (
            "--max-reply-bytes",
            "bytes of one reply message (the default is under the 4 MiB every stock gRPC "
            "client accepts; clients must be told to accept more)",
        ),
        ("--max-concurrent-rpcs", "calls in flight, queued ones included; more are refused at once"),
    ):
        name = flag[2:].replace("-", "_")
        env_name = "REST_" + name.upper()
        limits.add_argument(
            flag,
            type=int,
            metavar="N",
            default=env(env_name, str(getattr(DEFAULT_SERVER, name))),
            help=f"{help_text} (default: ${env_name} or %(default)s)",
        )
    exposure = cmd.add_argument_group(
        "exposure",
        "the server binds 127.0.0.1 unless --host says otherwise; beyond this machine, serve over TLS "
        "and require a token",
    )
    exposure.add_argument(
        "--tls-cert",
        metavar="PEM",
        type=Path,
        default=env("REST_TLS_CERT"),
        help="serve over TLS with this certificate (chain) (default: $REST_TLS_CERT)",
    )
    exposure.add_argument(
        "--tls-key",
        metavar="PEM",
        type=Path,
        default=env("REST_TLS_KEY"),
        help="the certificate's private key (default: $REST_TLS_KEY)",
    )
    token = exposure.add_mutually_exclusive_group()
    token.add_argument(
        "--auth-token",
        metavar="TOKEN",
        default=env("REST_AUTH_TOKEN"),
        help="require 'authorization: Bearer TOKEN' metadata on the calls in --auth-scope; "
        "visible to other local users in the process list: prefer $REST_AUTH_TOKEN or "
        "--auth-token-file (default: $REST_AUTH_TOKEN)",
    )
    token.add_argument(
        "--auth-token-file",
        metavar="FILE",
        type=Path,
        help="read the token from this file (surrounding whitespace ignored)",
    )
    exposure.add_argument(
        "--auth-scope",
        choices=AUTH_SCOPES,
        default=env("REST_AUTH_SCOPE", "add-output"),
        help="calls that need the token: AddOutput only, or every Datastore call (health and "
        "reflection stay open) (default: $REST_AUTH_SCOPE or %(default)s)",
    )
    cmd.add_argument(
        "--outputs-max-tokens",
        type=int,
        metavar="N",
        default=env("REST_OUTPUTS_MAX_TOKENS", str(DEFAULT_SERVER.outputs_max_tokens)),
        help="size of the store of recent outputs that clients add (AddOutput) and that "
        "drafts like the index; the oldest outputs are evicted beyond it; 0 keeps none "
        "(default: $REST_OUTPUTS_MAX_TOKENS or %(default)s)",
    )
    cmd.add_argument(
        "--outputs-dir",
        type=Path,
        metavar="DIR",
        default=env("REST_OUTPUTS_DIR"),
        help="keep the output store in this directory (an append-only log, fsynced "
        "before each AddOutput is answered) so it survives restarts (default: "
        "$REST_OUTPUTS_DIR, else in memory only)",
    )
    cmd.add_argument(
        "--outputs-salvage",
        action="store_true",
        help="open an --outputs-dir log that has damaged records by keeping every valid "
        "record and dropping the damaged bytes (a warning says how many); without it such a "
        "log is refused",
    )
    operations = cmd.add_argument_group("operations")
    operations.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        default=env("REST_METRICS_PORT"),
        help="serve Prometheus metrics at http://HOST:PORT/metrics on --host (requests by method and "
        "status, latencies, shards, output-store size); 0 picks a free port (default: "
        "$REST_METRICS_PORT, else none)",
    )
    operations.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=env("REST_LOG_FORMAT", "text"),
        help="log lines as text or one JSON object per line (default: $REST_LOG_FORMAT or %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="rest-datastore",
        description="Serve, inspect and query a REST suffix-array datastore.",
        epilog=f"gRPC's own log is silenced unless GRPC_VERBOSITY is set (e.g. GRPC_VERBOSITY=debug). {EXIT_STATUSES}",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve_cmd = sub.add_parser(
        "serve",
        help="serve an index (or, with --shards, some of its shards to a router) over gRPC until SIGTERM/SIGINT",
        epilog=EXIT_STATUSES,
    )
    _add_index(serve_cmd)
    serve_cmd.add_argument(
        "--shards",
        metavar="SPEC",
        default=env("REST_SHARDS"),
        help="serve only these shards of the index (manifest numbers, e.g. 0-3,7) over the internal shard "
        "service, for `rest-datastore route`; one --index only; the output store options do not apply, and "
        "with --auth-token every call needs the token (default: $REST_SHARDS)",
    )
    serve_cmd.add_argument(
        "--check-index",
        action="store_true",
        default=_env_flag("REST_CHECK_INDEX"),
        help="check every index array at open (suffix-array entries in range, token ids "
        "below the vocabulary): reads the whole index once (default: $REST_CHECK_INDEX)",
    )
    _add_server_arguments(serve_cmd)
    serve_cmd.set_defaults(run=run_serve, parser=serve_cmd)

    route_cmd = sub.add_parser(
        "route",
        help="serve the datastore service from shard servers (`serve --shards`) until SIGTERM/SIGINT",
        description="Answer the public datastore service, tree for tree as one server with the whole index, by "
        "asking the shard servers of the index and merging; the output store lives here.",
        epilog=EXIT_STATUSES,
    )
    route_cmd.add_argument(
        "--manifest",
        default=env("REST_MANIFEST"),
        help="the index's manifest.json (or its directory; the shard files need not be here) (default: $REST_MANIFEST)",
    )
    route_cmd.add_argument(
        "--shard-servers",
        metavar="H:P,H:P",
        default=env("REST_SHARD_SERVERS"),
        help="every shard server of the index; together they must serve each shard exactly once "
        "(default: $REST_SHARD_SERVERS)",
    )
    route_cmd.add_argument(
        "--shard-timeout",
        type=float,
        metavar="S",
        default=env("REST_SHARD_TIMEOUT", str(RouterConfig.timeout)),
        help="seconds a call to a shard server may take before it counts as down, or less when the "
        "client's own deadline is nearer (default: $REST_SHARD_TIMEOUT or %(default)s)",
    )
    route_cmd.add_argument(
        "--connect-timeout",
        type=float,
        metavar="S",
        default=env("REST_CONNECT_TIMEOUT", str(RouterConfig.connect_timeout)),
        help="seconds to wait at start for every shard server to answer (default: $REST_CONNECT_TIMEOUT or "
        "%(default)s)",
    )
    route_cmd.add_argument(
        "--allow-partial",
        action="store_true",
        default=_env_flag("REST_ALLOW_PARTIAL"),
        help="when a shard server is down or late, answer from the others (drafts from fewer shards; "
        "generation stays lossless) instead of UNAVAILABLE (default: $REST_ALLOW_PARTIAL)",
    )
    route_cmd.add_argument(
        "--shard-tls-ca",
        metavar="PEM",
        type=Path,
        default=env("REST_SHARD_TLS_CA"),
        help="reach the shard servers over TLS, trusting this CA certificate (default: $REST_SHARD_TLS_CA)",
    )
    route_cmd.add_argument(
        "--shard-auth-token",
        metavar="TOKEN",
        default=env("REST_SHARD_AUTH_TOKEN"),
        help="bearer token of shard servers started with --auth-token (default: $REST_SHARD_AUTH_TOKEN)",
    )
    _add_server_arguments(route_cmd)
    route_cmd.set_defaults(run=run_route, parser=route_cmd)

    info_cmd = sub.add_parser("info", help="print the index summary as JSON", epilog=EXIT_STATUSES)
    _add_source(info_cmd)
    info_cmd.set_defaults(run=run_info, parser=info_cmd)

    verify_cmd = sub.add_parser(
        "verify", help="check every index file against its sha256 in the manifest", epilog=EXIT_STATUSES
    )
    _add_index(verify_cmd)
    verify_cmd.set_defaults(run=run_verify, parser=verify_cmd)

    draft_cmd = sub.add_parser("draft", help="print the draft tree for one context", epilog=EXIT_STATUSES)
    _add_source(draft_cmd)
    context = draft_cmd.add_mutually_exclusive_group(required=True)
    context.add_argument("--tokens", type=_token_list, help="context token ids, e.g. 1,2,3")
    context.add_argument("--text", help="context text, tokenized with --tokenizer")
    draft_cmd.add_argument("--tokenizer", help="tokenizer spec (default: the one the index was built with)")
    draft_cmd.add_argument("--budget", type=int, default=DEFAULT_CONFIG.budget)
    draft_cmd.add_argument("--max-depth", type=int, default=DEFAULT_CONFIG.max_depth)
    draft_cmd.add_argument("--n-max", type=int, default=DEFAULT_CONFIG.n_max)
    draft_cmd.add_argument("--n-min", type=int, default=DEFAULT_CONFIG.n_min)
    draft_cmd.set_defaults(run=run_draft, parser=draft_cmd)
    return parser


def _need_index(args: argparse.Namespace) -> list[Path]:
    """The index directories of the --index flags, else of $REST_INDEX (each may list several)."""
    paths = index_paths(args.index or os.environ.get("REST_INDEX", ""))
    if not paths:
        raise UsageError("no index given: pass --index DIR (or set REST_INDEX)")
    return paths


def _open(args: argparse.Namespace):
    """The drafter the command reads from: an opened index or a gRPC client."""
    if getattr(args, "server", None):
        return DatastoreClient(args.server, timeout=args.timeout, tls_ca=args.tls_ca, auth_token=args.auth_token)
    return Datastore.open(_need_index(args))


def _auth_token(args: argparse.Namespace) -> str | None:
    """The token of --auth-token, or of --auth-token-file read and stripped."""
    if args.auth_token_file is None:
        return args.auth_token
    try:
        return args.auth_token_file.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read --auth-token-file {args.auth_token_file}: {first_line(exc)}") from None


def _server_config(args: argparse.Namespace, **extra) -> ServerConfig:
    """The ``ServerConfig`` of a server command's flags (``_add_server_arguments``)."""
    return _flag_values(
        ServerConfig,
        host=args.host,
        port=args.port,
        workers=args.workers,
        max_context_tokens=args.max_context_tokens,
        outputs_max_tokens=args.outputs_max_tokens,
        outputs_dir=Path(args.outputs_dir) if args.outputs_dir else None,
        outputs_salvage=args.outputs_salvage,
        max_batch_contexts=args.max_batch_contexts,
        max_request_bytes=args.max_request_bytes,
        max_reply_bytes=args.max_reply_bytes,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        auth_token=_auth_token(args),
        auth_scope=args.auth_scope,
        metrics_port=args.metrics_port,
        **extra,
    )


def _print_address(address: str) -> None:
    # the one stdout line: scripts (and tests) wait for it to learn the bound port
    print(f"listening on {address}", flush=True)


def run_serve(args: argparse.Namespace) -> None:
    index = _need_index(args)
    config = _server_config(args, check_index=args.check_index)
    if args.shards is None:
        serve(index, config, ready=_print_address)
        return
    if len(index) > 1:
        raise UsageError(f"--shards serves shards of one index, got {len(index)} (--index): serve several whole")
    if args.outputs_dir is not None or args.outputs_salvage:
        raise UsageError(
            "--outputs-dir and --outputs-salvage do not apply to --shards: the output store lives in the router"
        )
    shards = _flag_values(parse_shard_spec, spec=args.shards)
    serve_shards(index[0], shards, config, ready=_print_address)


def run_route(args: argparse.Namespace) -> None:
    if not args.manifest:
        raise UsageError("no manifest given: pass --manifest DIR/manifest.json (or set REST_MANIFEST)")
    if not args.shard_servers:
        raise UsageError("no shard servers given: pass --shard-servers HOST:PORT,... (or set REST_SHARD_SERVERS)")
    router_config = _flag_values(
        RouterConfig,
        shard_servers=tuple(a for a in args.shard_servers.replace(" ", "").split(",") if a),
        timeout=args.shard_timeout,
        connect_timeout=args.connect_timeout,
        allow_partial=args.allow_partial,
        tls_ca=args.shard_tls_ca,
        auth_token=args.shard_auth_token,
    )
    route(args.manifest, router_config, _server_config(args), ready=_print_address)


def run_info(args: argparse.Namespace) -> None:
    with _open(args) as source:
        print(json.dumps(dataclasses.asdict(source.info()), indent=2))


def run_verify(args: argparse.Namespace) -> None:
    with Datastore.open(_need_index(args), verify=True) as store:
        m = store.manifest
        index = ",".join(map(str, store.paths))
        print(json.dumps({"index": index, "verified": True, "shards": len(m.shards), "bytes": m.num_bytes}))


def run_draft(args: argparse.Namespace) -> None:
    config = _flag_values(DraftConfig, budget=args.budget, max_depth=args.max_depth, n_max=args.n_max, n_min=args.n_min)
    with _open(args) as source:
        tokenizer = None
        if args.text is not None or args.tokenizer is not None:
            tokenizer = _tokenizer_for(source, args.tokenizer)
        context = args.tokens if args.tokens is not None else tokenizer(args.text, add_special_tokens=False).input_ids
        tree = source.draft(context, config)
    print(format_tree(tree, tokenizer))


def _tokenizer_for(source, spec: str | None):
    """The tokenizer named by ``spec`` or by the index manifest, refused if its fingerprint differs."""
    if spec is None:
        name = source.info().tokenizer_name
        spec = None if name == SMOLLM2_GGUF else name
    tokenizer = load_tokenizer(spec)
    check_tokenizer(source, tokenizer_fingerprint(tokenizer))
    return tokenizer


def format_tree(tree: DraftTree, tokenizer=None) -> str:
    """The tree as indented lines, depth first: token id, text (with a tokenizer), count and score."""
    lines = [
        f"match_len={tree.match_len} num_matches={tree.num_matches} num_sampled={tree.num_sampled} nodes={len(tree)}"
    ]
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(tree.parents.tolist()):
        children.setdefault(parent, []).append(i)
    scores = tree.scores
    stack = list(reversed(children.get(-1, [])))
    while stack:
        i = stack.pop()
        token = int(tree.tokens[i])
        text = f" {tokenizer.decode([token])!r}" if tokenizer is not None else ""
        indent = "  " * int(tree.depths[i])
        lines.append(f"{indent}{token}{text}  count={int(tree.counts[i])} score={scores[i]:.3f}")
        stack.extend(reversed(children.get(i, [])))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(
        logging.INFO if args.command in ("serve", "route") else logging.WARNING,
        getattr(args, "log_format", "text"),  # a server flag
    )
    return run_command("rest-datastore", lambda: args.run(args), failures=FAILURES, parser=args.parser)


if __name__ == "__main__":
    sys.exit(main())
