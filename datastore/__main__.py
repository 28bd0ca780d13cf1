"""``rest-datastore``: serve an index over gRPC, describe or verify it, draft from it by hand.

    rest-datastore serve  --index DIR [--host 127.0.0.1] [--port 50051] [--workers 8]
                          [--outputs-max-tokens 1000000] [--outputs-dir DIR]
    rest-datastore info   --index DIR | --server HOST:PORT
    rest-datastore verify --index DIR
    rest-datastore draft  --index DIR | --server HOST:PORT  --tokens 1,2,3 | --text "..." [--tokenizer SPEC]

Errors are one line on stderr and exit status 1; usage errors exit 2.
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

from datastore.errors import first_line  # noqa: E402
from datastore.index import Datastore  # noqa: E402
from datastore.server import ServerConfig, serve  # noqa: E402
from datastore.tokenizer import SMOLLM2_GGUF, check_tokenizer, load_tokenizer, tokenizer_fingerprint  # noqa: E402
from datastore.types import DraftConfig, DraftTree  # noqa: E402
from datastore.client import DatastoreClient  # noqa: E402

DEFAULT_CONFIG = DraftConfig()
DEFAULT_SERVER = ServerConfig()


def _token_list(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if not tokens:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return tokens


def _add_source(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--index", help="index directory (default: $REST_INDEX)")
    group.add_argument("--server", metavar="HOST:PORT", help="a running `rest-datastore serve`")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for --server (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="rest-datastore",
        description="Serve, inspect and query a REST suffix-array datastore.",
        epilog="gRPC's own log is silenced unless GRPC_VERBOSITY is set (e.g. GRPC_VERBOSITY=debug).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve_cmd = sub.add_parser("serve", help="serve an index over gRPC until SIGTERM/SIGINT")
    serve_cmd.add_argument("--index", default=env("REST_INDEX"), help="index directory (default: $REST_INDEX)")
    serve_cmd.add_argument("--host", default=env("REST_HOST", DEFAULT_SERVER.host),
                           help="address to bind (default: $REST_HOST or %(default)s)")
    serve_cmd.add_argument("--port", type=int, default=env("REST_PORT", str(DEFAULT_SERVER.port)),
                           help="0 picks a free port (default: $REST_PORT or %(default)s)")
    serve_cmd.add_argument("--workers", type=int, default=env("REST_WORKERS", str(DEFAULT_SERVER.workers)),
                           help="request threads (default: $REST_WORKERS or %(default)s)")
    serve_cmd.add_argument("--max-context-tokens", type=int, default=DEFAULT_SERVER.max_context_tokens,
                           help="longest context a request may carry (default: %(default)s)")
    serve_cmd.add_argument("--outputs-max-tokens", type=int,
                           default=env("REST_OUTPUTS_MAX_TOKENS", str(DEFAULT_SERVER.outputs_max_tokens)),
                           help="size of the store of recent outputs that clients add (AddOutput) and that "
                           "drafts like the index; the oldest outputs are evicted beyond it; 0 keeps none "
                           "(default: $REST_OUTPUTS_MAX_TOKENS or %(default)s)")
    serve_cmd.add_argument("--outputs-dir", type=Path, default=env("REST_OUTPUTS_DIR"),
                           help="keep the output store in this directory (an append-only log, fsynced "
                           "before each AddOutput is answered) so it survives restarts (default: "
                           "$REST_OUTPUTS_DIR, else in memory only)")
    serve_cmd.set_defaults(run=run_serve)

    info_cmd = sub.add_parser("info", help="print the index summary as JSON")
    _add_source(info_cmd)
    info_cmd.set_defaults(run=run_info)

    verify_cmd = sub.add_parser("verify", help="check every index file against its sha256 in the manifest")
    verify_cmd.add_argument("--index", default=env("REST_INDEX"), help="index directory (default: $REST_INDEX)")
    verify_cmd.set_defaults(run=run_verify)

    draft_cmd = sub.add_parser("draft", help="print the draft tree for one context")
    _add_source(draft_cmd)
    context = draft_cmd.add_mutually_exclusive_group(required=True)
    context.add_argument("--tokens", type=_token_list, help="context token ids, e.g. 1,2,3")
    context.add_argument("--text", help="context text, tokenized with --tokenizer")
    draft_cmd.add_argument("--tokenizer", help="tokenizer spec (default: the one the index was built with)")
    draft_cmd.add_argument("--budget", type=int, default=DEFAULT_CONFIG.budget)
    draft_cmd.add_argument("--max-depth", type=int, default=DEFAULT_CONFIG.max_depth)
    draft_cmd.add_argument("--n-max", type=int, default=DEFAULT_CONFIG.n_max)
    draft_cmd.add_argument("--n-min", type=int, default=DEFAULT_CONFIG.n_min)
    draft_cmd.set_defaults(run=run_draft)
    return parser


def _need_index(args: argparse.Namespace) -> str:
    if not args.index:
        raise ValueError("no index given: pass --index DIR (or set REST_INDEX)")
    return args.index


def _open(args: argparse.Namespace):
    """The drafter the command reads from: an opened index or a gRPC client."""
    if getattr(args, "server", None):
        return DatastoreClient(args.server, timeout=args.timeout)
    return Datastore.open(_need_index(args))


def run_serve(args: argparse.Namespace) -> None:
    config = ServerConfig(
        host=args.host,
        port=args.port,
        workers=args.workers,
        max_context_tokens=args.max_context_tokens,
        outputs_max_tokens=args.outputs_max_tokens,
        outputs_dir=Path(args.outputs_dir) if args.outputs_dir else None,
    )
    # the one stdout line: scripts (and tests) wait for it to learn the bound port
    serve(_need_index(args), config, ready=lambda address: print(f"listening on {address}", flush=True))


def run_info(args: argparse.Namespace) -> None:
    with _open(args) as source:
        print(json.dumps(dataclasses.asdict(source.info()), indent=2))


def run_verify(args: argparse.Namespace) -> None:
    with Datastore.open(_need_index(args), verify=True) as store:
        m = store.manifest
        print(json.dumps({"index": str(store.path), "verified": True, "shards": len(m.shards), "bytes": m.num_bytes}))


def run_draft(args: argparse.Namespace) -> None:
    config = DraftConfig(budget=args.budget, max_depth=args.max_depth, n_max=args.n_max, n_min=args.n_min)
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
    logging.basicConfig(
        level=logging.INFO if args.command == "serve" else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        args.run(args)
    except (OSError, ValueError, RuntimeError) as exc:  # index, connection, tokenizer and request errors
        print(f"rest-datastore: error: {first_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
