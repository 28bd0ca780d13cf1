"""Opening a datastore from what a user names: an index directory (in process), several as one
("A,B": comma-separated directories) or HOST:PORT (a ``rest-datastore serve``). One opener for every engine and tool, so each refuses the same
mistakes with the same words, naming the setting they came from."""

from __future__ import annotations

import re
from pathlib import Path

from rest_spec.common.cli import first_line
from rest_spec.drafter.core.steps import DraftSource

ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):\d{1,5}$")  # HOST:PORT, [IPv6]:PORT


def open_datastore(
    spec: str,
    *,
    where: str = "datastore",
    tls_ca: str | None = None,
    auth_token: str | None = None,
    outputs_max_tokens: int | None = None,
    outputs_dir: str | None = None,
    outputs_from: str | None = None,
) -> DraftSource:
    """A ``LocalDrafter`` for an index directory, or comma-separated directories answering as one
    (with its store of outputs: ``outputs_max_tokens``, ``outputs_dir``; or a copy of the store of
    the server at ``outputs_from``, HOST:PORT), a ``RemoteDrafter`` for HOST:PORT (over TLS with
    ``tls_ca``, sending ``auth_token``; the same for ``outputs_from``). It is asked for its ``info()`` here, so a broken index or a dead server fails
    now, not at the first draft: ``ValueError`` naming ``where`` (the setting ``spec`` came from)."""
    if Path(spec).is_dir() or "," in spec:
        from rest_spec.datastore.index import index_paths
        from rest_spec.datastore.outputs import DEFAULT_OUTPUTS_MAX_TOKENS
        from rest_spec.drafter.core.local import LocalDrafter

        outputs = DEFAULT_OUTPUTS_MAX_TOKENS if outputs_max_tokens is None else outputs_max_tokens
        paths = index_paths(spec)
        if outputs_from is not None and not ADDRESS.match(outputs_from):
            raise ValueError(
                f"outputs_from {outputs_from!r} (a server whose store of outputs to copy) is not a HOST:PORT address"
            )
        opener, kind = (
            lambda: LocalDrafter.open(
                paths,
                outputs_max_tokens=outputs,
                outputs_dir=outputs_dir,
                outputs_from=outputs_from,
                tls_ca=tls_ca,
                auth_token=auth_token,
            ),
            ("index" if len(paths) == 1 else f"{len(paths)} indexes")
            + ("" if outputs_from is None else f", outputs copied from {outputs_from}"),
        )
    elif ADDRESS.match(spec):
        if outputs_max_tokens is not None or outputs_dir is not None or outputs_from is not None:
            raise ValueError(
                f"{where} {spec!r} is a server, which keeps its own outputs (rest-datastore serve --outputs-dir); "
                "an outputs size, directory or server to copy is for an index directory"
            )
        from rest_spec.drafter.core.remote import RemoteDrafter

        opener, kind = lambda: RemoteDrafter(spec, tls_ca=tls_ca, auth_token=auth_token), "server"
    else:
        raise ValueError(f"{where} {spec!r}: no such index directory, and not a HOST:PORT address")
    source = None
    try:
        source = opener()
        source.info()
    # Index format errors are ValueErrors; unreachable servers ConnectionErrors (OSError); other
    # server-side failures RuntimeErrors.
    except (OSError, ValueError, RuntimeError) as exc:
        if source is not None:
            source.close()
        raise ValueError(
            f"cannot use {where} {spec!r} ({kind}): {first_line(exc)}"
        ) from None  # one line naming the setting: the cause is in it
    return source
