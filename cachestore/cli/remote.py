"""The ``cachestore`` commands of the remote tier::

    cachestore inspect URL [--json] [--verify]
    cachestore prune URL [--keep N] [--dry-run] [--partial] [--json]
    cachestore push PREFIX URL [--generation G] [--json]
    cachestore pull URL PREFIX [--generation G] [--json]

URL is a remote root (``s3://bucket/path``, ``file:///shared/path``) or one store below it
(``.../<key>``); endpoint and credentials come from the ``AWS_*`` environment variables.
``push`` publishes a local store's newest committed generation (or ``--generation``),
finishing an interrupted publish; ``pull`` downloads one into PREFIX (a store there must
have the same fingerprint; a new PREFIX takes the remote's). Thin over :mod:`cachestore.remote`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..errors import CacheStoreError
from ..remote.url import is_remote_url
from ..space.disk import format_size

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


def add_commands(commands: Any) -> None:
    """Add ``push`` and ``pull`` to the ``cachestore`` parser (`commands`: its subparsers), and ``--json``
    to ``prune``; ``inspect`` and ``prune`` of a URL come here through :func:`handles`."""
    prune = commands.choices.get("prune")
    if prune is not None and "--json" not in prune._option_string_actions:
        prune.add_argument("--json", action="store_true", help="print one JSON document (remote stores)")
    push = commands.add_parser("push", help="publish a local store's generation to a remote (s3://, file://)",
                               description="Publish the newest committed generation of the store at PREFIX (or "
                                           "--generation) to the remote URL, finishing an interrupted publish.")
    push.add_argument("path", metavar="PREFIX", help="the local store (the loader's prefix)")
    push.add_argument("url", metavar="URL", help="the remote root, s3://bucket/path or file:///shared/path")
    push.add_argument("--generation", type=int, default=None, metavar="G")
    push.add_argument("--json", action="store_true", help="print one JSON document")
    push.set_defaults(run=None, remote_run=_push)
    pull = commands.add_parser("pull", help="download a published generation into a local store",
                               description="Download the newest complete generation of the remote URL (or "
                                           "--generation) into the store at PREFIX, every record verified.")
    pull.add_argument("path", metavar="URL", help="the remote root or store, s3://... or file://...")
    pull.add_argument("prefix", metavar="PREFIX", help="the local store to download into")
    pull.add_argument("--generation", type=int, default=None, metavar="G")
    pull.add_argument("--json", action="store_true", help="print one JSON document")
    pull.set_defaults(run=None, remote_run=_pull)


def handles(args: argparse.Namespace) -> bool:
    """Whether this module runs the parsed command (push, pull, or inspect/prune of a URL)."""
    return getattr(args, "remote_run", None) is not None or is_remote_url(getattr(args, "path", None))


def run(args: argparse.Namespace) -> int:
    """Run a remote command; its exit status (errors to stderr, naming no credential)."""
    command = getattr(args, "remote_run", None) or {"inspect": _inspect, "prune": _prune}[args.command]
    try:
        status: int = command(args)
        return status
    except (CacheStoreError, OSError, ValueError) as exc:
        from ..remote.settings import redact

        print(f"cachestore: error: {redact(str(exc))}", file=sys.stderr)
        return EXIT_PROBLEMS


def _open(url: str) -> Any:
    from ..remote import open_remote

    return open_remote(url)


def _inspect(args: argparse.Namespace) -> int:
    from ..remote import open_remote
    from ..remote.client import Client
    from ..remote.layout import STORE_KEY
    from ..remote.settings import remote_settings

    settings = remote_settings(args.path)
    tail = str(settings.url).rstrip("/").rsplit("/", 1)[-1]
    keys = [tail] if STORE_KEY.match(tail) else [k for k in Client(settings).list_dirs() if STORE_KEY.match(k)]
    stores, status = [], EXIT_OK
    for key in keys:
        remote = open_remote(args.path) if STORE_KEY.match(tail) else open_remote(args.path, key=key)
        doc: dict[str, Any] = {"url": remote.path, "key": remote.key}
        try:
            meta = remote.doc()
            doc.update(backend=meta["backend"], fingerprint=meta["fingerprint"], producer=meta["producer"])
            doc["generations"] = [{"id": g.id, "complete": g.complete, "num_samples": g.num_samples,
                                   "nparts": g.nparts, "published_parts": list(g.published),
                                   "claimed_parts": list(g.claimed), **g.extra} for g in remote.remote_generations()]
            if args.verify:
                bad = remote.verify()
                doc["problems"] = [str(e) for e in bad]
                status = EXIT_PROBLEMS if bad else status
        except CacheStoreError as exc:
            doc["problems"] = [str(exc)]
            status = EXIT_PROBLEMS
        stores.append(doc)
    out = {"url": str(settings.url), "stores": stores}
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return status
    print(f"{settings.url}: {len(stores)} store{'s' if len(stores) != 1 else ''}")
    for doc in stores:
        print(f"\n{doc['url']}  ({doc.get('backend', '?')})")
        for g in doc.get("generations", []):
            state = "complete" if g["complete"] else (f"parts {len(g['published_parts'])}/{g['nparts']} published, "
                                                      f"{len(g['claimed_parts'])} claimed")
            size = f", {format_size(g['bytes'])}" if "bytes" in g else ""
            print(f"  generation {g['id']}: {state}, {g['num_samples']} samples{size}, layout {g.get('layout', '-')}")
        for problem in doc.get("problems", []):
            print(f"  problem: {problem}")
    return status


def _prune(args: argparse.Namespace) -> int:
    remote = _open(args.path)
    removed = remote.prune(keep=args.keep, dry_run=args.dry_run, partial=args.partial)
    doc = {"url": remote.path, "dry_run": args.dry_run,
           "removed": [{"kind": r.kind, "path": r.path, "bytes": r.nbytes, "generation": r.generation}
                       for r in removed]}
    if getattr(args, "json", False):
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    would = "would remove" if args.dry_run else "removed"
    for r in removed:
        print(f"{would} {r.kind} {r.path} ({format_size(r.nbytes)})")
    print(f"{would} {len(removed)} item(s), {format_size(sum(r.nbytes for r in removed))}")
    return EXIT_OK


def _push(args: argparse.Namespace) -> int:
    from ..remote import open_remote
    from ..store import open_local

    local = open_local(args.path, readonly=True)
    remote = open_remote(args.url, local=local)
    t0 = time.perf_counter()
    handle = remote.publish(local, args.generation, background=False)
    info = handle.wait()
    doc = {"url": remote.path, "generation": info.id, "num_samples": info.num_samples, "bytes": handle.total_bytes,
           "skipped_bytes": handle.skipped_bytes, "seconds": round(time.perf_counter() - t0, 3)}
    print(json.dumps(doc, indent=2) if args.json else
          f"published generation {info.id} of {args.path} to {remote.path} ({format_size(handle.total_bytes)}, "
          f"{format_size(handle.skipped_bytes)} already there)")
    return EXIT_OK


def _pull(args: argparse.Namespace) -> int:
    from ..remote import open_remote
    from ..store import open_local

    remote = open_remote(args.path)
    meta = remote.doc()
    local = open_local(args.prefix, meta["backend"], compression=meta["compression"], fingerprint=meta["fingerprint"])
    t0 = time.perf_counter()
    info = remote.fetch(local, args.generation)
    doc = {"url": remote.path, "prefix": args.prefix, "generation": info.id, "num_samples": info.num_samples,
           "bytes": info.nbytes, "seconds": round(time.perf_counter() - t0, 3)}
    print(json.dumps(doc, indent=2) if args.json else
          f"pulled generation {info.id} ({info.num_samples} samples) of {remote.path} into {args.prefix}")
    return EXIT_OK
